"""The engine base class of the software engines (tcp, shm): memory table, peers, posting and
completions; everything but the transport, whose connections live in
:mod:`kvtransfer.connection`."""

from __future__ import annotations

import abc
import itertools
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer import auth
from kvtransfer.base import (ArrivalHandler, EngineStats, Memory, PeerId, TransferEngine, WriteCompletion,
                             WriteHandle, WriteOp, write_arrays)
from kvtransfer.config import EngineConfig
from kvtransfer.connection import InboundConnection, Listener, OutboundStream, Shared, ThreadGroup
from kvtransfer.endpoint import EndpointId, EndpointInfo, MemoryRegion, TransportAddress, local_host_id
from kvtransfer.errors import AuthError, PeerLostError, RemoteAccessError, TransferError
from kvtransfer.memory import check_bounds
from kvtransfer.staging import Mirror, Stager, allocate_mirror, home_bytes


@dataclass(slots=True)
class OutboundPeer:
    info: EndpointInfo
    streams: list[OutboundStream]


def check_remote_ranges(ops: Sequence[WriteOp], lengths: dict[int, int]) -> RemoteAccessError | None:
    """The error rejecting ``ops`` as a batch when one names a key not in ``lengths`` (remote key
    -> region bytes) or a range outside its region; None when every write fits. For engines whose
    writer is the only place a write can be checked (shm, cuda_ipc: no NIC, no receiver copy)."""
    if (arrays := write_arrays(ops)) is not None:
        if ops.remote_key not in lengths:
            return RemoteAccessError(f"unknown remote memory key {ops.remote_key:#x}; batch rejected")
        size, (_, offsets, n) = lengths[ops.remote_key], arrays
        bad = (offsets < 0) | (n <= 0) | (offsets + n > size)
        if not bad.any():
            return None
        ops = ops[int(bad.argmax()):]   # the first bad write, reported as below
    key, size = None, 0
    for op in ops:
        if op.remote_key != key:
            if op.remote_key not in lengths:
                return RemoteAccessError(f"unknown remote memory key {op.remote_key:#x}; batch rejected")
            key, size = op.remote_key, lengths[op.remote_key]
        if op.remote_offset < 0 or op.length <= 0 or op.remote_offset + op.length > size:
            return RemoteAccessError(f"range [{op.remote_offset}, {op.remote_offset + op.length}) outside "
                                     f"remote region of {size} bytes; batch rejected")
    return None


def split_by_bytes(ops: Sequence[WriteOp], parts: int) -> list[Sequence[WriteOp]]:
    """Deal ``ops`` over at most ``parts`` non-empty parts of about equal bytes. A `WriteOps`
    is cut into consecutive runs of writes at the byte quantiles (each a `WriteOps`: its arrays
    travel on); a list, op by op to the currently lightest part (stable)."""
    if (arrays := write_arrays(ops)) is not None:
        ends = np.cumsum(arrays[2])
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1
        bounds = sorted({0, len(ops), *np.minimum(cuts, len(ops)).tolist()})
        return [ops.rows(a, b) for a, b in zip(bounds, bounds[1:])]
    buckets: list[list[WriteOp]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for op in ops:
        i = loads.index(min(loads))
        buckets[i].append(op)
        loads[i] += op.length
    return [b for b in buckets if b]


class SoftwareEngine(TransferEngine):
    """Base of tcp and shm: memory table, peers, tracker, threads. Subclasses supply the
    transport: :meth:`_transport` (what ``describe`` advertises) and :meth:`_open_peer`.

    A batch of at least ``STRIPE_MIN_BYTES`` is striped over the peer's streams by bytes; a
    smaller one (a layer of a short prompt's KV) goes whole to the next stream in turn: striping
    it would cost more in per-part work than parallel streams gain.
    """

    STRIPE_MIN_BYTES = 1 << 20
    MIRROR_ALLOCATOR = None   # staged registrations' mirrors: shm's in shared memory (it receives there)
    MAX_PREAUTH = 16   # inbound connections still handshaking; more are closed at once

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        self._s = shared if shared is not None else Shared.create(config, arrivals)
        self._threads = ThreadGroup()
        self._lock = threading.Lock()
        self._peers: dict[PeerId, OutboundPeer] = {}
        self._by_endpoint: dict[str, PeerId] = {}
        self._inbound: set[InboundConnection] = set()
        self._peer_ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._next_stream = itertools.count()
        self._closed = False
        self._listener: Listener | None = None
        self._mirrors: dict[int, Mirror] = {}   # staged registrations' host mirrors
        self._local = threading.local()

    # -- transport hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    def _transport(self) -> TransportAddress: ...

    @abc.abstractmethod
    def _open_peer(self, info: EndpointInfo, tag: str) -> list[OutboundStream]: ...

    @abc.abstractmethod
    def _serve_connection(self, sock: socket.socket) -> InboundConnection: ...

    # -- TransferEngine -----------------------------------------------------------------------
    @property
    def endpoint_id(self) -> EndpointId:
        return self._s.endpoint_id

    def register_memory(self, memory: Memory, *, shared: object | None = None, stage: bool = False) -> MemoryRegion:
        """As `TransferEngine.register_memory`; a CUDA tensor (or any tensor with ``stage``) is
        registered staged (`kvtransfer.staging`): the engine allocates its host mirror (in shared
        memory for shm) and registers that; ``shared`` is then ignored."""
        self._check_open()
        if isinstance(memory, torch.Tensor) and (memory.is_cuda or stage):
            home = home_bytes(memory)
            mirror = allocate_mirror(memory, self.MIRROR_ALLOCATOR)
            try:
                reg = self._s.memory.register(mirror.tensor, mirror.handle, home=home)
            except BaseException:
                mirror.release()
                raise
            with self._lock:
                self._mirrors[reg.region.key] = mirror
            return reg.region
        return self._s.memory.register(memory, shared).region

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._s.memory.deregister(region.key)
        with self._lock:
            mirror = self._mirrors.pop(region.key, None)
        if mirror is not None:
            mirror.release()

    def stager(self) -> Stager:
        """This thread's `kvtransfer.staging.Stager` over the engine's memory table."""
        stager = getattr(self._local, "stager", None)
        if stager is None:
            stager = self._local.stager = Stager(self._s.memory.get)
        return stager

    def describe(self) -> EndpointInfo:
        return EndpointInfo(self._s.endpoint_id, local_host_id(), self._s.memory.regions(), (self._transport(),))

    def connect(self, peer: EndpointInfo) -> PeerId:
        self._check_open()
        with self._lock:
            existing = self._by_endpoint.get(peer.endpoint_id)
            if existing is not None:
                return existing
            peer_id = PeerId(f"{self.name}:{next(self._peer_ids)}")
        streams = self._open_peer(peer, peer_id.replace(":", ""))
        with self._lock:
            self._peers[peer_id] = OutboundPeer(peer, streams)
            self._by_endpoint[peer.endpoint_id] = peer_id
        return peer_id

    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        state = self._peer(peer)
        nbytes = self._check_local(ops)
        rejected = self._check_remote(state, ops)
        if rejected is not None:
            self._s.counters.add(writes_rejected=len(ops))
            handle = self._s.tracker.new(peer, 1, len(ops), nbytes)
            self._s.tracker.fail(handle, rejected)
            return handle
        live = [s for s in state.streams if s.broken is None]
        if not live:
            raise PeerLostError(f"peer {peer} is lost")
        self._s.counters.add(writes_posted=len(ops), bytes_posted=nbytes)
        if not ops:
            return self._s.tracker.new(peer, 0, 0, 0)
        if len(live) == 1 or nbytes < self.STRIPE_MIN_BYTES:
            handle = self._s.tracker.new(peer, 1, len(ops), nbytes)
            live[next(self._next_stream) % len(live)].submit(handle, ops, nbytes)
            return handle
        parts = split_by_bytes(ops, len(live))
        handle = self._s.tracker.new(peer, len(parts), len(ops), nbytes)
        for stream, part in zip(live, parts):
            arrays = write_arrays(part)
            stream.submit(handle, part, int(arrays[2].sum()) if arrays is not None else sum(op.length for op in part))
        return handle

    def _local_table(self):
        """The memory table a writer's local keys are looked up in (the shared one)."""
        return self._s.memory

    def _check_local(self, ops: Sequence[WriteOp]) -> int:
        """Total bytes of ``ops``; ``RemoteAccessError`` if a local region is not registered or
        a local range leaves it (nothing is posted then)."""
        nbytes, key, length, table = 0, None, 0, self._local_table()
        if (arrays := write_arrays(ops)) is not None:
            reg = table.get(ops.local.key)
            if reg is None:
                raise RemoteAccessError(f"local region key {ops.local.key:#x} is not registered")
            offsets, _, n = arrays
            bad = (offsets < 0) | (n <= 0) | (offsets + n > reg.region.length)
            if bad.any():
                i = int(bad.argmax())
                check_bounds(reg.region, int(offsets[i]), int(n[i]))
            return int(n.sum())
        for op in ops:
            if op.local.key != key:
                reg = table.get(op.local.key)
                if reg is None:
                    raise RemoteAccessError(f"local region key {op.local.key:#x} is not registered")
                key, length = op.local.key, reg.region.length
            offset, n = op.local_offset, op.length
            if offset < 0 or n <= 0 or offset + n > length:
                check_bounds(reg.region, offset, n)
            nbytes += n
        return nbytes

    def _check_remote(self, peer: OutboundPeer, ops: Sequence[WriteOp]) -> RemoteAccessError | None:
        """Writer-side check of remote keys and ranges (shm); the error fails the whole batch
        before anything is written. The tcp receiver checks instead, so this returns None."""
        return None

    def poll(self) -> list[WriteCompletion]:
        return self._s.tracker.poll()

    def wait(self, handle: WriteHandle, timeout_s: float | None = None) -> WriteCompletion:
        return self._s.tracker.wait(handle, timeout_s)

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            state = self._peers.pop(peer, None)
            if state is not None:
                self._by_endpoint.pop(state.info.endpoint_id, None)
        if state is not None:
            for stream in state.streams:
                stream.close(self._s.config.close_timeout_s)
            self._s.tracker.fail_peer(peer, PeerLostError(f"disconnected from {peer}"))

    def stats(self) -> EngineStats:
        return self._s.counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers)
        for peer in peers:
            self.disconnect(peer)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            inbound = list(self._inbound)
        for conn in inbound:
            conn.shutdown()
        alive = self._threads.join_all(self._s.config.close_timeout_s)
        if alive:
            raise TransferError(f"threads did not stop: {alive}")
        with self._lock:   # no thread copies any more: the mirrors' pinning goes
            mirrors, self._mirrors = list(self._mirrors.values()), {}
        for mirror in mirrors:
            mirror.release()

    # -- helpers for subclasses -----------------------------------------------------------------
    def _listen_unix(self, path: str) -> None:
        """Listen on the abstract Unix socket ``path`` (``@name``) for same-host writers."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + path[1:])
        sock.listen(128)
        self._start_listener(sock)

    def _connect_unix(self, path: str, receive: Callable[[socket.socket], object]) -> tuple[socket.socket, object]:
        """Connect to a same-host peer's abstract Unix socket ``path``, authenticate with the
        cluster secret, then ``receive(sock)`` what the peer sends after authentication (its
        export table); returns the socket and that. Raises AuthError (secret mismatch),
        TransferError (unreachable, or whatever ``receive`` raises); the socket is closed then."""
        cfg = self._s.config
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(cfg.connect_timeout_s)
            sock.connect("\0" + path[1:])
            auth.client_handshake(sock, cfg.secret, self._s.endpoint_id)
            received = receive(sock)
            sock.settimeout(None)
        except (AuthError, TransferError):
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot connect to {self.name} peer {path}: {exc}") from exc
        return sock, received

    def _start_listener(self, sock: socket.socket) -> None:
        self._listener = Listener(sock, f"kv-{self.name}-listen", self._threads, self._accept)

    def _accept(self, sock: socket.socket) -> None:
        """A new inbound connection: its own thread, unless the engine is closed or
        ``MAX_PREAUTH`` connections are still handshaking (closed at once and counted as an
        auth failure: no thread, no buffer before authentication)."""
        with self._lock:
            preauth = sum(1 for c in self._inbound if not c.authenticated)
            if self._closed or preauth >= self.MAX_PREAUTH:
                sock.close()
                if not self._closed:
                    self._s.counters.add(auth_failures=1)
                return
        conn = self._serve_connection(sock)
        with self._lock:
            self._inbound.add(conn)
        self._threads.start(f"kv-{self.name}-rx-{next(self._conn_ids)}", self._run_inbound, conn)

    def _run_inbound(self, conn: InboundConnection) -> None:
        try:
            conn.run()
        finally:
            with self._lock:
                self._inbound.discard(conn)

    def _peer(self, peer: PeerId) -> OutboundPeer:
        with self._lock:
            state = self._peers.get(peer)
        if state is None:
            raise TransferError(f"unknown peer {peer}")
        return state

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
