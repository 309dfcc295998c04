"""The ``verbs`` transfer engine: RDMA WRITE WITH IMMEDIATE over RC queue pairs.

Modules: `engine` (`VerbsEngine`: builds the pieces, the contract, close), `device` (context, PD,
CQ, SRQ, port and GID), `memory` (registered memory), `qp` (one QP's states), `links` (a
connection's QP set), `writer` (outbound peers, posting, reconnects), `receiver` (inbound
connections), `cq` (the completion loop), `bootstrap` (handshakes, the socket watch), `gpu` (CUDA
registration and flush), `compat` (pyverbs releases) and `support` (the device-free parts:
constants, records, GID choice).

pyverbs is imported lazily (`compat.import_pyverbs`), so this package and `support` import on a
host without it; building a `VerbsEngine` there fails with `EngineUnavailableError`.
"""
