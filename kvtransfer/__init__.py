"""pdserve's KV data plane: one-sided writes with 32-bit immediates into a peer's KV pool.

Lifecycle of one request's KV (decode = receiver, prefill = writer)::

    decode start    pool_u8, shm = allocate_shared_buffer(layout.total_bytes)   # or any tensor
                    counter = CompletionCounter(num_slots)
                    engine = create_engine("auto", cfg, arrivals=counter)
                    region = engine.register_memory(pool_u8, shared=shm)
                    blob = engine.describe().to_bytes()          -> router (Register/Connect)
    prefill start   engine = create_engine("auto", cfg); local = engine.register_memory(pool)
                    peer = engine.connect(EndpointInfo.from_bytes(blob))   # once per decode worker
    Reserve         decode: block_ids = allocator...; slot, gen = counter.acquire(deadline_s)
    Prefill         prefill, for each layer l as it finishes:
                        plan = plan_writes(src_layout, dst_layout, src_ids, dst_ids,
                                           max_write_bytes, layers=range(l, l + 1))
                        handles.append(engine.post_writes(peer, to_write_ops(plan, local, region.key,
                                                                              pack_immediate(slot, gen))))
                    num_writes = count_writes(...all layers...); answer the router with it;
                    free/reuse the source blocks only after every handle completed (engine.wait).
    Decode          decode: counter.expect(slot, gen, num_writes, source=prefill_endpoint_id)
                            counter.wait(slot, gen)   # TransferTimeout / PeerLostError on failure
                            ... decode ...; counter.release(slot, gen) when the request ends.

Who frees what, when: a decode block is never reused while any peer could still write into it.
After COMPLETE nothing more arrives for the slot (the count is exact). After a failure or abort
the decode worker keeps the blocks until the writer confirmed it stopped (its handles completed or
it acknowledged the abort) or its connection is gone (``on_peer_lost`` fired / ``disconnect``);
``counter.release`` bumps the generation, so any write still landing afterwards is counted as
stale and its immediate dropped. A prefill worker keeps its source blocks until ``wait`` returned
(or raised) for each of the request's handles.

Engines (``create_engine(name, config, arrivals)``): ``tcp`` (software one-sided writes over TCP),
``shm`` (same host, shared memory + Unix socket), ``verbs`` (RDMA via pyverbs), ``auto`` (verbs if
an RDMA device exists and its set-up succeeds, else tcp with the reason logged; shm per peer on
the same host). This package imports only the
standard library, numpy and torch; pyverbs is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvtransfer.base import (ArrivalHandler, EngineStats, ImmediateQueue, PeerId, TransferEngine,
                             WriteCompletion, WriteHandle, WriteOp, WriteOps, WriteStatus)
from kvtransfer.config import EngineConfig, VerbsConfig
from kvtransfer.counter import CompletionCounter, CounterStats, SlotState, SlotStatus
from kvtransfer.endpoint import EndpointId, EndpointInfo, MemoryRegion, TransportAddress, TransportKind
from kvtransfer.errors import (AuthError, EngineUnavailableError, KVTransferError, NoRdmaDeviceError,
                               PeerLostError, PlanError, RemoteAccessError, TransferError,
                               TransferTimeout)
from kvtransfer.immediate import Generation, SlotId, pack_immediate, unpack_immediate
from kvtransfer.layout import KV, KVLayout
from kvtransfer.plan import PlannedWrite, count_writes, plan_writes
from kvtransfer.shm import SharedBuffer, allocate_shared_buffer

EngineFactory = Callable[[EngineConfig, "ArrivalHandler | None"], TransferEngine]


VECTOR_MIN_WRITES = 64
"""Plans of at least this many writes become `WriteOps` (their checks, copy plans and frames as
array operations); shorter ones stay lists, where a Python step per write costs less than the
arrays' fixed cost."""


def to_write_ops(plan: Iterable[PlannedWrite] | np.ndarray, local: MemoryRegion, remote_key: int,
                 imm: int | None) -> Sequence[WriteOp]:
    """Turn planned writes into engine ops; every op carries ``imm`` (so the count is exact).
    ``plan``: `PlannedWrite` objects, or the same writes as an int64 array of shape ``(writes, 3)``
    of ``(src offset, dst offset, length)`` (`kvtransfer.tp.plan_route_arrays`), taken as it is.
    A list, or for `VECTOR_MIN_WRITES` writes or more a `WriteOps` (a list of the same ops that
    also carries them as arrays)."""
    if isinstance(plan, np.ndarray):
        rows = plan.reshape(-1, 3)
        if len(rows) >= VECTOR_MIN_WRITES:
            return WriteOps(local, remote_key, imm, rows.astype(np.int64, copy=False))
        return [WriteOp(local, lo, remote_key, ro, n, imm) for lo, ro, n in rows.tolist()]
    rows = [(w.src_offset, w.dst_offset, w.length) for w in plan]
    if len(rows) >= VECTOR_MIN_WRITES:
        return WriteOps(local, remote_key, imm, np.array(rows, dtype=np.int64))
    return [WriteOp(local, lo, remote_key, ro, n, imm) for lo, ro, n in rows]


def _tcp(config: EngineConfig, arrivals: ArrivalHandler | None) -> TransferEngine:
    from kvtransfer.tcp import TcpEngine
    return TcpEngine(config, arrivals)


def _shm(config: EngineConfig, arrivals: ArrivalHandler | None) -> TransferEngine:
    from kvtransfer.shm import ShmEngine
    return ShmEngine(config, arrivals)


def _verbs(config: EngineConfig, arrivals: ArrivalHandler | None) -> TransferEngine:
    from kvtransfer.verbs.engine import VerbsEngine
    return VerbsEngine(config, arrivals)


def _auto(config: EngineConfig, arrivals: ArrivalHandler | None) -> TransferEngine:
    from kvtransfer.auto import AutoEngine
    return AutoEngine(config, None, arrivals)


def _cuda_ipc(config: EngineConfig, arrivals: ArrivalHandler | None) -> TransferEngine:
    from kvtransfer.cuda_ipc import CudaIpcEngine
    return CudaIpcEngine(config, arrivals)


_ENGINES: dict[str, EngineFactory] = {"tcp": _tcp, "shm": _shm, "verbs": _verbs, "auto": _auto,
                                      "cuda_ipc": _cuda_ipc}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make ``create_engine(name, ...)`` build engines with ``factory``; ``ValueError`` if taken."""
    if name in _ENGINES:
        raise ValueError(f"engine {name!r} is already registered")
    _ENGINES[name] = factory


def engine_names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def create_engine(name: str, config: EngineConfig, arrivals: ArrivalHandler | None = None) -> TransferEngine:
    """Build the engine ``name`` (``auto``, ``tcp``, ``shm``, ``verbs``, ``cuda_ipc``).

    ``arrivals`` receives remote immediates and lost writers (default: an :class:`ImmediateQueue`).
    Raises ``EngineUnavailableError`` for an unknown name or when the engine cannot run here
    (``NoRdmaDeviceError`` for verbs without a device, with the reason).
    """
    factory = _ENGINES.get(name)
    if factory is None:
        raise EngineUnavailableError(f"unknown transfer engine {name!r}; known: {', '.join(_ENGINES)}")
    return factory(config, arrivals)


__all__ = [
    "ArrivalHandler", "AuthError", "CompletionCounter", "CounterStats", "EndpointId", "EndpointInfo",
    "EngineConfig", "EngineStats", "EngineUnavailableError", "Generation", "ImmediateQueue", "KV",
    "KVLayout", "KVTransferError", "MemoryRegion", "NoRdmaDeviceError", "PeerId", "PeerLostError",
    "PlanError", "PlannedWrite", "RemoteAccessError", "SharedBuffer", "SlotId", "SlotState",
    "SlotStatus", "TransferEngine", "TransferError", "TransferTimeout", "TransportAddress",
    "TransportKind", "VerbsConfig", "WriteCompletion", "WriteHandle", "WriteOp", "WriteOps", "WriteStatus",
    "allocate_shared_buffer", "count_writes", "create_engine", "engine_names", "pack_immediate",
    "plan_writes", "register_engine", "to_write_ops", "unpack_immediate",
]
