"""The transfer engine interface: one-sided writes with immediates into a peer's registered memory.

Roles and who calls what (one engine instance per worker process; every worker can be both):

Receiver (decode worker)
    1. ``engine = create_engine(name, config, arrivals=counter)`` - ``arrivals`` receives every
       remote immediate (``on_immediate``), every abnormal loss of a writer's connection
       (``on_peer_lost``), and when a writer is first connected and when it has no connection
       left (``on_peer_connected`` / ``on_peer_gone``), from engine threads.
    2. ``region = engine.register_memory(kv_pool)`` once, before ``describe()``.
    3. ``engine.describe().to_bytes()`` -> the router -> each prefill worker.
    4. Nothing else per request: writes land in the pool without the receiver's CPU doing more
       than copying (tcp) or nothing at all (shm, verbs); the counter does the bookkeeping.

Writer (prefill worker)
    1. ``engine = create_engine(name, config)``; ``local = engine.register_memory(kv_pool)``.
    2. ``peer = engine.connect(EndpointInfo.from_bytes(blob))`` once per decode worker.
    3. Per request and layer: ``handle = engine.post_writes(peer, ops)`` - returns at once, the
       writes proceed in the background; the caller must keep the source bytes unchanged until
       the handle completes.
    4. ``engine.wait(handle, timeout_s)`` or ``engine.poll()`` for local completions. A completion
       means the receiver applied (or rejected) every write of the batch and delivered the
       immediates of the applied ones.
    5. ``engine.disconnect(peer)`` / ``engine.close()``.

Ownership: registered memory belongs to the caller and must outlive the engine (or its
``deregister``); the engine never frees it. A writer's source blocks are borrowed from
``post_writes`` until the handle completes (or fails). A receiver's destination blocks may be
written by a peer until that peer's writes complete, it acknowledges an abort, or its connection
is gone (``on_peer_lost`` / ``disconnect``).
"""

from __future__ import annotations

import abc
import queue
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NewType, Protocol

import numpy as np
import torch

from kvtransfer.endpoint import EndpointInfo, MemoryRegion
from kvtransfer.errors import KVTransferError, TransferError

PeerId = NewType("PeerId", str)
WriteHandle = NewType("WriteHandle", int)


@dataclass(frozen=True, slots=True)
class WriteOp:
    """One one-sided write: ``length`` bytes from ``local`` + ``local_offset`` into the peer's
    region ``remote_key`` at ``remote_offset``; ``imm`` (host-order 32-bit, see
    :mod:`kvtransfer.immediate`) is delivered to the receiver after the bytes are in place, or
    nothing is delivered when ``imm`` is None."""

    local: MemoryRegion
    local_offset: int
    remote_key: int
    remote_offset: int
    length: int
    imm: int | None = None


class WriteOps(Sequence[WriteOp]):
    """A batch of writes from one local region to one remote region, every one carrying the same
    immediate (what `kvtransfer.to_write_ops` builds for a long plan), held as ``arrays``: int64
    arrays of local offsets, remote offsets and lengths (each ``[N]``, bytes), so that the
    engines' range checks, device copy plans, frame descriptors and striping take a few array
    operations instead of one Python step per write. It is also a read-only sequence of the same
    `WriteOp` objects, built on first use (an engine that walks the ops one by one: tcp's payloads,
    verbs' work requests) and kept; an index gives one op, a slice a plain list. Immutable: to
    change the batch, make a list of it (``list(ops)``) and post that."""

    __slots__ = ("local", "remote_key", "imm", "arrays", "_ops")

    def __init__(self, local: MemoryRegion, remote_key: int, imm: int | None, writes: np.ndarray) -> None:
        """``writes``: ``[N, 3]`` int64 rows of (local offset, remote offset, length)."""
        writes = np.asarray(writes, dtype=np.int64).reshape(-1, 3)
        self.local, self.remote_key, self.imm = local, remote_key, imm
        self.arrays: tuple[np.ndarray, np.ndarray, np.ndarray] = tuple(
            np.ascontiguousarray(c) for c in writes.T)   # type: ignore[assignment]
        self._ops: list[WriteOp] | None = None

    def _list(self) -> list[WriteOp]:
        ops = self._ops
        if ops is None:   # two threads may both build it: the lists are equal
            lo, ro, n = (a.tolist() for a in self.arrays)
            local, key, imm = self.local, self.remote_key, self.imm
            ops = self._ops = [WriteOp(local, a, key, b, c, imm) for a, b, c in zip(lo, ro, n)]
        return ops

    def rows(self, start: int, stop: int) -> "WriteOps":
        """Writes ``start:stop`` as a `WriteOps` (arrays sliced, no op built)."""
        out = WriteOps.__new__(WriteOps)
        out.local, out.remote_key, out.imm, out._ops = self.local, self.remote_key, self.imm, None
        out.arrays = tuple(a[start:stop] for a in self.arrays)   # type: ignore[assignment]
        return out

    def __len__(self) -> int:
        return len(self.arrays[2])

    def __getitem__(self, index):   # an int: one op; a slice: a plain list
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, WriteOps)):
            return NotImplemented
        return len(self) == len(other) and self._list() == list(other)

    __hash__ = None   # type: ignore[assignment]

    def __add__(self, other: Sequence[WriteOp]) -> list[WriteOp]:
        return self._list() + list(other)

    def __radd__(self, other: Sequence[WriteOp]) -> list[WriteOp]:
        return list(other) + self._list()

    def __repr__(self) -> str:
        return f"WriteOps({len(self)} writes, {int(self.arrays[2].sum())} bytes, key {self.remote_key:#x})"


def write_arrays(ops: Sequence[WriteOp]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``ops.arrays`` of a non-empty `WriteOps`; else None (a list: walked op by op)."""
    return ops.arrays if isinstance(ops, WriteOps) and len(ops) else None


def merged_ranges(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """``(remote offset, local offset, bytes)`` copies of a `WriteOps`' ``arrays``, in write order,
    each run of writes contiguous with the one before on both sides merged into one copy: an int64
    array of shape ``(copies, 3)`` (no Python object per copy: a scattered plan is ~10^5 of them)."""
    lo, ro, n = arrays
    starts = np.concatenate(([0], np.flatnonzero((ro[1:] != ro[:-1] + n[:-1]) | (lo[1:] != lo[:-1] + n[:-1])) + 1))
    return np.stack([ro[starts], lo[starts], np.add.reduceat(n, starts)], axis=1).astype(np.int64, copy=False)


class WriteStatus(IntEnum):
    PENDING = 0
    OK = 1
    FAILED = 2


@dataclass(frozen=True, slots=True)
class WriteCompletion:
    """The local completion of one ``post_writes`` batch.

    ``error`` is set iff ``status`` is FAILED: ``RemoteAccessError`` (some writes rejected by the
    receiver, nothing of them written), ``PeerLostError`` (connection lost; any subset may have
    landed), ``TransferError`` (engine closed)."""

    handle: WriteHandle
    status: WriteStatus
    num_writes: int
    nbytes: int
    error: KVTransferError | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Monotonic counters since the engine was created."""

    writes_posted: int = 0
    bytes_posted: int = 0
    writes_received: int = 0
    bytes_received: int = 0
    writes_rejected: int = 0
    auth_failures: int = 0
    peers_lost: int = 0


class ArrivalHandler(Protocol):
    """Receiver-side sink; :class:`kvtransfer.counter.CompletionCounter` implements it.

    Every method is called from engine threads and must not block for long or raise.
    """

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        """``count`` writes carrying ``imm`` from writer ``source`` (its endpoint id) are in place.

        Engines may aggregate consecutive arrivals of the same immediate into one call, never
        before every payload counted is in place."""

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        """The connection from writer ``source`` ended abnormally (died, reset, protocol error)."""

    def on_peer_connected(self, source: str) -> None:
        """Writer ``source``'s first live connection to this engine is up (authenticated)."""

    def on_peer_gone(self, source: str) -> None:
        """Writer ``source``'s last live connection to this engine has ended, gracefully (BYE) or
        not (after ``on_peer_lost``): nothing of it can land in this engine's memory any more
        until it connects again (`kvtransfer.connection.PeerConnections`)."""


class ImmediateQueue:
    """The default :class:`ArrivalHandler`: a queue of ``(imm, source)``, of lost connections and of
    the writers connected and gone."""

    def __init__(self) -> None:
        self.immediates: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self.lost: queue.SimpleQueue[tuple[str, TransferError]] = queue.SimpleQueue()
        self.connected: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.gone: queue.SimpleQueue[str] = queue.SimpleQueue()

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        for _ in range(count):
            self.immediates.put((imm, source))

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        self.lost.put((source, error))

    def on_peer_connected(self, source: str) -> None:
        self.connected.put(source)

    def on_peer_gone(self, source: str) -> None:
        self.gone.put(source)


Memory = torch.Tensor | tuple[int, int]


class TransferEngine(abc.ABC):
    """One-sided write engine. Every method may be called from any thread unless noted."""

    name: str = ""

    @abc.abstractmethod
    def register_memory(self, memory: Memory, *, shared: object | None = None) -> MemoryRegion:
        """Register a contiguous tensor or an ``(addr, length)`` range for local reads and remote
        writes. ``shared`` is the handle from :func:`kvtransfer.shm.allocate_shared_buffer` when
        the memory lives in it (lets same-host peers write with one memcpy); ignored by engines
        without a shared-memory path. Call before :meth:`describe` so peers see the region.

        Raises ``TransferError`` for non-contiguous tensors or memory the engine cannot reach
        (e.g. CUDA memory for tcp).
        """

    @abc.abstractmethod
    def deregister_memory(self, region: MemoryRegion) -> None:
        """Stop accepting writes into ``region``; later writes naming its key are rejected."""

    @abc.abstractmethod
    def describe(self) -> EndpointInfo:
        """This endpoint for peers. Side-effect free; may be called any number of times."""

    @abc.abstractmethod
    def connect(self, peer: EndpointInfo) -> PeerId:
        """Connect and authenticate to ``peer``; blocks up to ``connect_timeout_s``.

        Raises ``AuthError`` (secret mismatch), ``TransferError`` (unreachable, version mismatch).
        Connecting twice to the same endpoint returns the existing ``PeerId``.
        """

    @abc.abstractmethod
    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        """Start ``ops`` towards ``peer``; returns at once with a handle for ``wait``/``poll``.

        Writes within a batch and across batches may land in any order. Local ranges are checked
        here (``RemoteAccessError`` raised, nothing posted); remote keys and bounds are checked by
        the receiver and reported as a FAILED completion. Raises ``TransferError`` for an unknown
        or lost peer.
        """

    @abc.abstractmethod
    def poll(self) -> list[WriteCompletion]:
        """Finished completions not yet consumed by ``poll`` or ``wait``; never blocks."""

    @abc.abstractmethod
    def wait(self, handle: WriteHandle, timeout_s: float | None = None) -> WriteCompletion:
        """Block until ``handle`` completes; consume and return its completion.

        Raises the completion's error if it FAILED, ``TransferTimeout`` if ``timeout_s`` passes
        (the handle stays pending), ``TransferError`` for an unknown or consumed handle.
        """

    @abc.abstractmethod
    def disconnect(self, peer: PeerId) -> None:
        """Close the connection to ``peer`` after its posted writes are sent; pending handles
        of that peer that cannot complete fail with ``PeerLostError``. Idempotent."""

    def flush_arrivals(self) -> None:
        """Receiver: call after a slot's count completed, before compute reads its blocks.

        Makes the bytes that arrived visible to the device that reads them. A no-op for host
        memory (the completion already orders them); the verbs engine with a CUDA region flushes
        GPUDirect RDMA writes (``cuFlushGPUDirectRDMAWrites``). May be called from any thread;
        raises ``TransferError`` if the flush fails.
        """

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Counters (see :class:`EngineStats`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect every peer, stop and join every engine thread, fail pending handles.
        Idempotent. Registered memory is not freed (the caller owns it)."""

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
