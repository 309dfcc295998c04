"""The membership table: which workers exist, their state, load and data-plane links.

Lifecycle of a member (one transition function, `transition`):

    JOINING ──(brokered with >= 1 peer)──> CONNECTED ──(heartbeat says draining)──> DRAINING
       │                                      │                                        │
       └──────────── Leave / missed heartbeats / re-registration ────────────> GONE <──┘

A decode member of a table built with ``standalone_decode`` (colocated / auto serving modes,
`router.serving`) starts CONNECTED: it can serve ``ServeColocated`` without any prefill peer.

Only CONNECTED members whose last heartbeat reports no dead or stalled loop
(``LoadStats.unhealthy``, `worker.liveness`) are routable. GONE is absorbing: the member is removed from the table
and a worker that comes back registers as a new member (a new ``epoch``).

Thread safety: every method takes the table's lock; the registry's gRPC threads, the broker and
monitor threads and the HTTP event loop all call in. Listeners (`add_listener`) are called after
any change, outside the lock, from whichever thread made it.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import rpc
from router.kvindex import KVIndex
from rpc import pdserve_pb2 as pb


class WorkerState(enum.IntEnum):
    JOINING = 0
    CONNECTED = 1
    DRAINING = 2
    GONE = 3


_ALLOWED = {
    WorkerState.JOINING: {WorkerState.CONNECTED, WorkerState.DRAINING, WorkerState.GONE},
    WorkerState.CONNECTED: {WorkerState.DRAINING, WorkerState.GONE},
    WorkerState.DRAINING: {WorkerState.GONE},
    WorkerState.GONE: set(),
}


def transition(current: WorkerState, new: WorkerState) -> WorkerState:
    """The one state transition function. Raises `ValueError` on a transition not allowed."""
    if new == current:
        return current
    if new not in _ALLOWED[current]:
        raise ValueError(f"worker state cannot go from {current.name} to {new.name}")
    return new


ROLE_NAMES = {pb.PREFILL: "prefill", pb.DECODE: "decode"}


@dataclass(frozen=True)
class Load:
    """A worker's last reported load (`rpc` ``LoadStats``), in blocks, sequences and tokens."""

    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    draining: bool = False
    reserved_blocks: int = 0
    unhealthy: bool = False
    unhealthy_reason: str = ""

    @classmethod
    def from_pb(cls, m: pb.LoadStats) -> "Load":
        return cls(m.free_blocks, m.total_blocks, m.running, m.waiting, m.queued_prompt_tokens,
                   m.draining, m.reserved_blocks, m.unhealthy, m.unhealthy_reason)


@dataclass(frozen=True)
class Member:
    """An immutable view of one member (the table hands out copies).

    ``role`` is "prefill" or "decode"; ``heartbeats`` counts heartbeats received (policy uses
    it to know whether a load figure already reflects a reservation); ``epoch`` is unique per
    registration.
    """

    worker_id: str
    role: str
    grpc_address: str
    host_id: str
    model_name: str
    num_blocks: int
    block_size: int
    transfer_engine: str
    epoch: int
    state: WorkerState = WorkerState.JOINING
    load: Load = field(default_factory=Load)
    heartbeats: int = 0
    last_seen: float = 0.0
    peers: frozenset[str] = frozenset()
    prefix_caching: bool = False   # keeps a prefix cache and publishes its KV events
    tensor_parallel_size: int = 1  # TP ranks (processes) of the worker

    @property
    def routable(self) -> bool:
        """CONNECTED and its last heartbeat did not report a dead or stalled loop."""
        return self.state == WorkerState.CONNECTED and not self.load.unhealthy

    def as_json(self) -> dict:
        return {"id": self.worker_id, "role": self.role, "state": self.state.name,
                "grpc_address": self.grpc_address, "host_id": self.host_id,
                "transfer_engine": self.transfer_engine, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "peers": sorted(self.peers),
                "prefix_caching": self.prefix_caching, "tensor_parallel_size": self.tensor_parallel_size,
                "load": self.load.__dict__, "seconds_since_heartbeat":
                    round(time.monotonic() - self.last_seen, 3)}


class Refused(Exception):
    """A registration the table will not accept; the message is the reason sent back."""


class Membership:
    """The table. ``clock`` is injectable for tests (monotonic seconds); ``standalone_decode``:
    decode members are routable without a prefill peer (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, standalone_decode: bool = False):
        self._lock = threading.Lock()
        self._standalone_decode = standalone_decode
        self._members: dict[str, Member] = {}
        self._compat_hash: str | None = None
        self._epochs = itertools.count(1)
        self._clock = clock
        self._listeners: list[Callable[[], None]] = []
        self.kv_index = KVIndex()   # what each member's prefix cache holds (router.kvindex)
        # membership events since start: joins, rejoins, leaves, deaths, refusals
        self.events: dict[str, int] = {"join": 0, "rejoin": 0, "leave": 0, "death": 0, "refused": 0}

    # -- registration -----------------------------------------------------------------------
    def register(self, info: pb.WorkerInfo) -> tuple[Member, Member | None]:
        """Admit a worker. Returns ``(member, replaced)``: ``replaced`` is the previous member
        with the same id (now GONE; its peers must be disconnected), or None.

        Raises:
            Refused: wrong protocol version, compatibility hash mismatch, unknown role,
                missing id or address.
        """
        try:
            return self._register(info)
        except Refused:
            self.events["refused"] += 1
            raise

    def _register(self, info: pb.WorkerInfo) -> tuple[Member, Member | None]:
        if info.protocol_version != rpc.PROTOCOL_VERSION:
            raise Refused(f"protocol version {info.protocol_version} is not the router's "
                          f"{rpc.PROTOCOL_VERSION}; upgrade the older side")
        if info.role not in ROLE_NAMES:
            raise Refused(f"unknown role {info.role}")
        if not info.worker_id or not info.grpc_address:
            raise Refused("worker_id and grpc_address are required")
        with self._lock:
            if self._compat_hash is not None and info.compat_hash != self._compat_hash:
                raise Refused(
                    f"compatibility hash {info.compat_hash!r} differs from the cluster's "
                    f"{self._compat_hash!r} (model, dtype, block size or KV layout differ)")
            self._compat_hash = self._compat_hash or info.compat_hash
            replaced = self._members.pop(info.worker_id, None)
            role = ROLE_NAMES[info.role]
            member = Member(info.worker_id, role, info.grpc_address,
                            info.host_id, info.model_name, info.num_blocks, info.block_size,
                            info.transfer_engine, next(self._epochs), last_seen=self._clock(),
                            prefix_caching=info.prefix_caching,
                            tensor_parallel_size=max(1, info.tensor_parallel_size),
                            state=WorkerState.CONNECTED if self._standalone_decode and role == "decode"
                            else WorkerState.JOINING)
            self._members[member.worker_id] = member
            self.kv_index.drop(member.worker_id)   # its first heartbeat brings a snapshot
            self.events["rejoin" if replaced is not None else "join"] += 1
            if replaced is not None:
                self._drop_links(replaced)
                replaced = replace(replaced, state=WorkerState.GONE)
        self._notify()
        return member, replaced

    def heartbeat(self, worker_id: str, load: Load) -> bool:
        """Record a heartbeat; False when the worker is unknown (it must register again)."""
        with self._lock:
            m = self._members.get(worker_id)
            if m is None:
                return False
            state = transition(m.state, WorkerState.DRAINING) if load.draining else m.state
            self._members[worker_id] = replace(m, load=load, heartbeats=m.heartbeats + 1,
                                               last_seen=self._clock(), state=state)
        self._notify()
        return True

    def leave(self, worker_id: str, reason: str = "leave") -> Member | None:
        """Remove a worker; returns its last view (state GONE, with its peers) or None.
        ``reason``: "leave" (it said so) or "death" (missed heartbeats), counted in `events`."""
        with self._lock:
            m = self._members.pop(worker_id, None)
            if m is None:
                return None
            self.events[reason] += 1
            self.kv_index.drop(worker_id)
            self._drop_links(m)
            gone = replace(m, state=transition(m.state, WorkerState.GONE))
        self._notify()
        return gone

    def expire(self, dead_after_s: float) -> list[Member]:
        """Remove every worker silent for longer than ``dead_after_s``; returns them (GONE)."""
        now = self._clock()
        with self._lock:
            dead = [m for m in self._members.values() if now - m.last_seen > dead_after_s]
        return [g for g in (self.leave(m.worker_id, "death") for m in dead) if g is not None]

    # -- links --------------------------------------------------------------------------------
    def link(self, prefill_id: str, decode_id: str, epochs: tuple[int, int]) -> bool:
        """Record a brokered pair; both become CONNECTED (unless draining). False when either
        side is gone or re-registered since brokering began (``epochs`` of the pair)."""
        with self._lock:
            p, d = self._members.get(prefill_id), self._members.get(decode_id)
            if p is None or d is None or (p.epoch, d.epoch) != epochs:
                return False
            for m, peer in ((p, decode_id), (d, prefill_id)):
                state = m.state if m.state != WorkerState.JOINING else WorkerState.CONNECTED
                self._members[m.worker_id] = replace(
                    m, peers=m.peers | {peer}, state=transition(m.state, state))
        self._notify()
        return True

    def unlinked_pairs(self) -> list[tuple[Member, Member]]:
        """(prefill, decode) pairs of live, non-draining members not yet brokered, whatever their
        tensor parallel sizes (their ranks connect rank to rank: `worker.tp_rank`)."""
        with self._lock:
            live = [m for m in self._members.values()
                    if m.state in (WorkerState.JOINING, WorkerState.CONNECTED)]
        return [(p, d) for p in live if p.role == "prefill" for d in live
                if d.role == "decode" and d.worker_id not in p.peers]

    def _drop_links(self, gone: Member) -> None:
        for peer_id in gone.peers:
            peer = self._members.get(peer_id)
            if peer is not None:
                self._members[peer_id] = replace(peer, peers=peer.peers - {gone.worker_id})

    # -- views --------------------------------------------------------------------------------
    def get(self, worker_id: str) -> Member | None:
        with self._lock:
            return self._members.get(worker_id)

    def members(self) -> list[Member]:
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.role, m.worker_id))

    def routable(self, role: str) -> list[Member]:
        return [m for m in self.members() if m.role == role and m.routable]

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every change (from the changing thread, outside the lock)."""
        self._listeners.append(fn)

    def _notify(self) -> None:
        for fn in list(self._listeners):
            fn()
