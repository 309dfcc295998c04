"""The data plane of a tensor-parallel worker's ranks: every rank is an endpoint of its own.

A worker at TP N is N processes (`engine.tp_ranks`): rank 0 serves gRPC and drives; ranks 1 .. N-1
follow. Each rank has its own transfer engine with its own pool registered (its KV heads; with
verbs its own MR and QPs), so KV moves rank to rank, straight between the pools that hold the
heads, never through rank 0:

- **Endpoints.** Rank 0 tells every follower to build its engine (`RankDataPlane`, the rank
  extension each follower runs: the ``kv_engine`` call) and publishes the group
  (`kvtransfer.group.GroupEndpoint`) as the worker's endpoint.
- **Writer (prefill) ranks.** A decode group's description reaches rank 0 (Connect); rank 0 and,
  through the ``kv_connect`` call, every follower connect to the decode ranks their routes name
  (`kvtransfer.tp.head_routes`; `DecodePeer`). A pass that finishes prompts carries their
  `PassWrites` to the followers (`engine.tp_ranks.LayerWork`); each rank posts the writes of its
  own routes (`post_layers`), at each layer or all once the pass ends as rank 0's worker chose
  (`WorkerConfig.kv_send`), every write carrying the request's immediate. A
  follower reports each job's completion to rank 0 (an event ``("kv_done", key, error, bytes)``),
  which retires the job only once every rank's writes completed.
- **Reader (decode) ranks.** A follower's engine hands its immediates and lost writers to rank 0
  (events ``("imm", imm, source, count)`` and ``("lost", source, reason)``), whose completion
  counter counts every rank's arrivals against the plan's total (`count_job_writes`): the bytes
  of a follower's heads are in its pool before its immediate is sent.

A follower that dies takes the group, and so the worker, with it (`engine.tp_ranks`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import host_buffer
from kvtransfer import (EngineConfig, KVLayout, KVTransferError, MemoryRegion, PeerId,
                        TransferEngine, TransferError, WriteHandle, allocate_shared_buffer, create_engine,
                        to_write_ops)
from kvtransfer.group import GroupEndpoint
from kvtransfer.tp import HeadRoute, count_route_writes, head_routes, plan_route_arrays

log = logging.getLogger(__name__)

TRANSFER_GRACE_S = 10.0   # how long past its lease a job's posted writes are waited for


@dataclass(frozen=True)
class DecodePeer:
    """A connected decode worker as one writer rank sees it.

    Fields:
        routes: every route from the writer group to the decode group (all writer ranks').
        targets: per decode rank this writer rank writes to: (engine peer id, that rank's pool
            layout, its region key).
        layouts: every decode rank's pool layout (rank order).
        rank: the writer rank holding this view.
    """

    routes: tuple[HeadRoute, ...]
    targets: dict[int, tuple[PeerId, KVLayout, int]]
    layouts: tuple[KVLayout, ...]
    rank: int = 0

    @property
    def layout(self) -> KVLayout:
        """Decode rank 0's pool layout (its block count is every rank's)."""
        return self.layouts[0]

    @property
    def own_routes(self) -> list[HeadRoute]:
        return [r for r in self.routes if r.src_rank == self.rank]


def connect_group(engine: TransferEngine, group: GroupEndpoint, local: KVLayout, num_kv_heads: int,
                  rank: int, tp_size: int, who: str) -> DecodePeer:
    """Connect writer rank ``rank`` (of a TP-``tp_size`` group whose pools are ``local``) to the
    decode ranks of ``group`` its routes name.

    Raises TransferError naming both sides when the groups cannot be bridged (another layout or
    KV heads, a TP size the heads do not split over), AuthError, TransferError (unreachable)."""
    rank_pools = group.rank_layouts(local, num_kv_heads, who)
    try:
        routes = tuple(head_routes(num_kv_heads, tp_size, group.tp_size))
    except ValueError as exc:   # PlanError
        raise TransferError(f"this worker at tensor parallel size {tp_size} cannot write to {who} at "
                            f"{group.tp_size}: {exc}") from exc
    targets: dict[int, tuple[PeerId, KVLayout, int]] = {}
    try:
        for dst in sorted({r.dst_rank for r in routes if r.src_rank == rank}):
            layout, key = rank_pools[dst]
            targets[dst] = (engine.connect(group.ranks[dst]), layout, key)
    except BaseException:
        for peer, _, _ in targets.values():
            engine.disconnect(peer)
        raise
    return DecodePeer(routes, targets, tuple(layout for layout, _ in rank_pools), rank)


def disconnect_group(engine: TransferEngine, peer: DecodePeer) -> None:
    for peer_id, _, _ in peer.targets.values():
        engine.disconnect(peer_id)


def post_layers(engine: TransferEngine, region: MemoryRegion, local: KVLayout, peer: DecodePeer,
                src_blocks: Sequence[int], dst_blocks: Sequence[int], imm: int, max_write_bytes: int,
                layers: Sequence[int]) -> tuple[list[WriteHandle], int]:
    """Post the writes of ``layers`` (one post per route) of this rank's routes to ``peer``:
    returns the handles and bytes. Raises PlanError / RemoteAccessError (nothing more posted),
    TransferError (peer lost)."""
    handles, nbytes = [], 0
    for route in peer.own_routes:
        peer_id, layout, key = peer.targets[route.dst_rank]
        rows = plan_route_arrays(local, layout, route, src_blocks, dst_blocks, max_write_bytes, layers)
        if len(rows):   # planned as arrays: no Python step per write on the pass's thread
            handles.append(engine.post_writes(peer_id, to_write_ops(rows, region, key, imm)))
            nbytes += int(rows[:, 2].sum())
    return handles, nbytes


def count_job_writes(local: KVLayout, peer: DecodePeer, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                     max_write_bytes: int) -> int:
    """The writes every writer rank posts for a job (every layer, every route): the immediates the
    decode group counts. ``local``: a writer rank's pool (each holds as many heads). Raises PlanError."""
    return sum(count_route_writes(local, peer.layouts[r.dst_rank], r, src_blocks, dst_blocks, max_write_bytes)
               for r in peer.routes)


@dataclass(frozen=True)
class JobWrites:
    """One job's writes for the follower ranks to post during a pass (`RankDataPlane.layer_hook`).

    Fields: ``key`` the job's number on rank 0; ``peer`` the decode worker's id;
    ``src_blocks``/``dst_blocks`` the prefill and decode block ids written (equal lengths);
    ``imm`` the immediate every write carries; ``deadline`` monotonic seconds (the host's clock,
    shared by the ranks) after which no write is posted."""

    key: int
    peer: str
    src_blocks: list[int]
    dst_blocks: list[int]
    imm: int
    deadline: float


@dataclass(frozen=True)
class PassWrites:
    """A pass's writes for the follower ranks: each finishing job's `JobWrites`, and whether
    they are posted at each layer (``per_layer``) or all once the pass ends."""

    jobs: list[JobWrites]
    per_layer: bool = True


class _ForwardArrivals:
    """A follower's arrival sink: every immediate, lost connection, and writer connected or gone
    goes to rank 0 as an event, in the order the rank's engine told them."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send

    def _tell(self, event: tuple) -> None:
        try:
            self._send(event)
        except OSError:   # rank 0 is gone: this process exits soon (tp-parent-watch)
            pass

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        self._tell(("imm", imm, source, count))

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        self._tell(("lost", source, str(error)))

    def on_peer_connected(self, source: str) -> None:
        self._tell(("connected", source))

    def on_peer_gone(self, source: str) -> None:
        self._tell(("gone", source))


class RankDataPlane:
    """A follower rank's data plane: the rank extension `engine.tp_ranks` runs in each follower
    (``worker.tp_rank:RankDataPlane``; module doc).

    Calls from rank 0 (`engine.tp_ranks.TensorParallelModel.call`):
        ``kv_buffer(shared: bool)`` before the pool: put it in shared memory (shm engine).
        ``kv_engine((engine name, EngineConfig, role, num_kv_heads, max_write_bytes))``: build the
            engine (port ``config.port + rank`` when fixed), register the pool; returns its
            `EndpointInfo` bytes. A decode rank's arrivals go to rank 0 as events.
        ``kv_connect((decode worker id, GroupEndpoint bytes))``: connect this rank's routes.
        ``kv_disconnect(decode worker id)``.
    Threads: ``tp-rank-sender`` (waits for each job's writes, reports ``kv_done``), stopped by
    `close`, with the engine's.
    """

    def __init__(self, rank: int, size: int, send: Callable[[tuple], None]):
        self.rank, self.size = rank, size
        self._send = send
        self._shared = False
        self._shm = None
        self._buffer: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self.engine: TransferEngine | None = None
        self.region: MemoryRegion | None = None
        self.peers: dict[str, DecodePeer] = {}
        self._num_kv_heads = 0
        self._max_write_bytes = 0
        self._pending: dict[int, list[WriteHandle]] = {}
        self._errors: dict[int, str] = {}
        self._bytes: dict[int, int] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- the follower's life --------------------------------------------------------------------
    def pool_buffer(self, nbytes: int) -> torch.Tensor:
        if self._shared:
            buffer, self._shm = allocate_shared_buffer(nbytes)
        else:
            buffer = host_buffer(nbytes)
        self._buffer = buffer[:nbytes]
        return buffer

    def pool_ready(self, pool) -> None:
        self.layout = KVLayout.from_tensor(pool.kv)

    def call(self, name: str, arg):
        if name == "kv_buffer":
            self._shared = bool(arg)
            return None
        if name == "kv_engine":
            return self._start_engine(*arg)
        if name == "kv_connect":
            peer_id, blob = arg
            self._disconnect(peer_id)
            self.peers[peer_id] = connect_group(self.engine, GroupEndpoint.from_bytes(blob), self.layout,
                                                self._num_kv_heads, self.rank, self.size, f"decode worker {peer_id}")
            return None
        if name == "kv_disconnect":
            self._disconnect(arg)
            return None
        raise ValueError(f"unknown data-plane call {name!r}")

    def _start_engine(self, name: str, config: EngineConfig, role: str, num_kv_heads: int,
                      max_write_bytes: int) -> bytes:
        if self.engine is not None or self._buffer is None:
            raise TransferError("the data plane is started once, after the pool")
        if config.port:
            config = dataclasses.replace(config, port=config.port + self.rank)
        self._num_kv_heads, self._max_write_bytes = num_kv_heads, max_write_bytes
        self.engine = create_engine(name, config, _ForwardArrivals(self._send) if role == "decode" else None)
        self.region = self.engine.register_memory(self._buffer, shared=self._shm)
        self._thread = threading.Thread(target=self._report, name="tp-rank-sender", daemon=True)
        self._thread.start()
        return self.engine.describe().to_bytes()

    def _disconnect(self, peer_id: str) -> None:
        peer = self.peers.pop(peer_id, None)
        if peer is not None:
            disconnect_group(self.engine, peer)

    # -- a pass's writes --------------------------------------------------------------------------
    def layer_hook(self, work: PassWrites):
        if not work.per_layer:
            return lambda layer: None   # posted by `after_pass`
        return lambda layer: self._post((layer,), work.jobs)

    def _post(self, layers: Sequence[int], work: list[JobWrites]) -> None:
        now = time.monotonic()
        for job in work:
            if job.key in self._errors:
                continue
            peer = self.peers.get(job.peer)
            if peer is None:
                self._errors[job.key] = f"rank {self.rank} is not connected to decode worker {job.peer!r}"
            elif now >= job.deadline:
                self._errors[job.key] = f"rank {self.rank}: the job passed its lease while computing"
            else:
                try:
                    handles, nbytes = post_layers(self.engine, self.region, self.layout, peer, job.src_blocks,
                                                  job.dst_blocks, job.imm, self._max_write_bytes, layers)
                except (KVTransferError, ValueError) as exc:
                    self._errors[job.key] = f"rank {self.rank}: {exc}"
                    continue
                self._pending.setdefault(job.key, []).extend(handles)
                self._bytes[job.key] = self._bytes.get(job.key, 0) + nbytes

    def after_pass(self, work: PassWrites) -> None:
        """Post every layer's writes when the pass posts at its end; then hand each job's handles
        to ``tp-rank-sender``, which reports it once they completed."""
        if not work.per_layer:
            self._post(range(self.layout.num_layers), work.jobs)
        for job in work.jobs:
            self._queue.put((job, self._pending.pop(job.key, []), self._errors.pop(job.key, None),
                             self._bytes.pop(job.key, 0)))

    def _report(self) -> None:
        while (item := self._queue.get()) is not None:
            job, handles, error, nbytes = item
            for h in handles:
                try:
                    self.engine.wait(h, timeout_s=max(0.1, job.deadline + TRANSFER_GRACE_S - time.monotonic()))
                except KVTransferError as exc:
                    error = error or f"rank {self.rank}: {type(exc).__name__}: {exc}"
            try:
                self._send(("kv_done", job.key, error, nbytes))
            except OSError:
                return

    def close(self) -> None:
        """Report what was handed over, stop ``tp-rank-sender``, close the engine. Idempotent."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None

