"""The ``verbs`` transfer engine: RDMA WRITE WITH IMMEDIATE over RC queue pairs.

Modules: `engine` (`VerbsEngine`: memory, peers, posting, the contract), `device` (context, PD,
CQ, SRQ, port and GID), `qp` (one QP's states), `cq` (the completion loop), `bootstrap`
(handshakes, the socket watch), `gpu` (CUDA registration and flush), `compat` (pyverbs
releases) and `support` (the device-free parts: constants, records, GID choice).

pyverbs is imported lazily (`compat.import_pyverbs`), so this package and `support` import on a
host without it; building a `VerbsEngine` there fails with `EngineUnavailableError`.
"""
