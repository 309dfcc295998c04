"""Machinery shared by the software engines (tcp, shm): listener, inbound connections, outbound
streams, and the engine base class implementing everything but the transport.

Threads (all named ``kv-<engine>-...``, all stopped by ``close()`` and joined there):

- ``kv-<e>-listen``: blocks in ``select`` on the listening socket and a wake pipe; accepts.
- ``kv-<e>-rx-<n>``: one per inbound writer connection; handshake, then blocks reading frames,
  places payloads, delivers immediates, sends acks.
- ``kv-<e>-tx-<peer>-<i>`` / ``kv-<e>-ack-<peer>-<i>``: per outbound stream; the first blocks on its
  work queue and sends, the second blocks reading acks and completes handles.
"""

from __future__ import annotations

import abc
import itertools
import queue
import selectors
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtransfer import auth
from kvtransfer.base import (ArrivalHandler, EngineStats, ImmediateQueue, Memory, PeerId,
                             TransferEngine, WriteCompletion, WriteHandle, WriteOp)
from kvtransfer.config import EngineConfig
from kvtransfer.endpoint import (EndpointId, EndpointInfo, MemoryRegion, TransportAddress,
                                 local_host_id)
from kvtransfer.errors import AuthError, KVTransferError, PeerLostError, RemoteAccessError, TransferError
from kvtransfer.frame import (HEADER_SIZE, Frame, FrameType, WireStatus, recv_exact,
                              unpack_frame)
from kvtransfer.memory import MemoryTable, check_bounds
from kvtransfer.tracker import CompletionTracker, EngineCounters


class ThreadGroup:
    """Named threads started by one engine; ``join_all`` reports the ones that did not stop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, name: str, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    def join_all(self, timeout_s: float) -> list[str]:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout_s)
        return [t.name for t in threads if t.is_alive()]


@dataclass(slots=True)
class Shared:
    """State shared by an engine and its connections (and by engines composed in ``auto``)."""

    config: EngineConfig
    endpoint_id: EndpointId
    memory: MemoryTable
    tracker: CompletionTracker
    counters: EngineCounters
    arrivals: ArrivalHandler

    @classmethod
    def create(cls, config: EngineConfig, arrivals: ArrivalHandler | None) -> "Shared":
        return cls(config, EndpointId(uuid.uuid4().hex), MemoryTable(), CompletionTracker(),
                   EngineCounters(), arrivals if arrivals is not None else ImmediateQueue())


class Listener:
    """Accept loop on a bound, listening socket; hands each connection to ``on_accept``."""

    def __init__(self, sock: socket.socket, name: str, threads: ThreadGroup,
                 on_accept: Callable[[socket.socket], None]) -> None:
        self.sock = sock
        self._on_accept = on_accept
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threads.start(name, self._run)

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self.sock and not self._stop.is_set():
                        try:
                            conn, _ = self.sock.accept()
                        except OSError:
                            continue
                        self._on_accept(conn)

    def close(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join()
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()


class InboundConnection(abc.ABC):
    """The receiver end of one writer stream: handshake, then :meth:`_serve` (the transport's frame
    loop) until BYE; an abnormal end is reported once to ``arrivals.on_peer_lost``.
    ``after_auth(sock)`` runs once after the handshake (shm sends its fds there)."""

    def __init__(self, shared: Shared, sock: socket.socket,
                 after_auth: Callable[[socket.socket], None] | None = None) -> None:
        self.sock = sock
        self._shared, self._after_auth = shared, after_auth
        self.closing = False
        self.source = ""

    def run(self) -> None:
        try:
            self.sock.settimeout(self._shared.config.connect_timeout_s)
            try:
                self.source = auth.server_handshake(self.sock, self._shared.config.secret)
                if self._after_auth is not None:
                    self._after_auth(self.sock)
            except (AuthError, OSError):
                self._shared.counters.add(auth_failures=1)
                return
            self.sock.settimeout(None)
            self._serve()
        except (OSError, KVTransferError) as exc:
            if not self.closing:
                self._shared.counters.add(peers_lost=1)
                self._shared.arrivals.on_peer_lost(self.source, PeerLostError(f"writer {self.source}: {exc}"))
        finally:
            self.sock.close()

    @abc.abstractmethod
    def _serve(self) -> None:
        """Read frames until BYE (return) or failure (raise)."""

    def _deliver(self, imms: list[int]) -> None:
        """Hand immediates to ``arrivals``, one call per run of equal values."""
        on_immediate, source = self._shared.arrivals.on_immediate, self.source
        i = 0
        while i < len(imms):
            j = i + 1
            while j < len(imms) and imms[j] == imms[i]:
                j += 1
            on_immediate(imms[i], source, j - i)
            i = j

    def _end_batch(self, seq: int, first_error: int, rejected: int, received: int, nbytes: int) -> None:
        """Account a batch part and answer its ACK_REQ frame."""
        self._shared.counters.add(writes_received=received, bytes_received=nbytes, writes_rejected=rejected)
        self.sock.sendall(Frame(FrameType.ACK, seq=seq, status=WireStatus(first_error), length=rejected).pack())

    def shutdown(self) -> None:
        self.closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def status_error(status: WireStatus, rejected: int) -> RemoteAccessError:
    return RemoteAccessError(f"receiver rejected {rejected} write(s): {status.name}")


class OutboundStream:
    """One writer connection: a tx thread draining a work queue, an ack thread completing handles.

    ``send_batch(sock, ops, seq)`` transmits one batch part, flagging its last frame ACK_REQ/``seq``.
    """

    def __init__(self, sock: socket.socket, name: str, shared: Shared, peer: str, threads: ThreadGroup,
                 send_batch: Callable[[socket.socket, Sequence[WriteOp], int], None]) -> None:
        self.sock, self._shared, self._peer, self._send_batch = sock, shared, peer, send_batch
        self._queue: queue.SimpleQueue[tuple[WriteHandle, Sequence[WriteOp]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding: dict[int, WriteHandle] = {}
        self._seq = itertools.count(1)
        self.broken: KVTransferError | None = None
        self._tx = threads.start(f"{name}-tx", self._run_tx)
        self._ack = threads.start(f"{name}-ack", self._run_ack)

    def submit(self, handle: WriteHandle, ops: Sequence[WriteOp]) -> None:
        self._queue.put((handle, ops))

    def _run_tx(self) -> None:
        while (item := self._queue.get()) is not None:
            handle, ops = item
            if self.broken is not None:
                self._shared.tracker.part_done(handle, self.broken)
                continue
            seq = next(self._seq)
            with self._lock:
                self._outstanding[seq] = handle
            try:
                self._send_batch(self.sock, ops, seq)
            except (OSError, KVTransferError) as exc:
                self._break(PeerLostError(f"send to {self._peer} failed: {exc}"))
        try:
            if self.broken is None:
                self.sock.sendall(Frame(FrameType.BYE).pack())
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _run_ack(self) -> None:
        hdr = memoryview(bytearray(HEADER_SIZE))
        try:
            while recv_exact(self.sock, hdr):
                frame = unpack_frame(hdr)
                with self._lock:
                    handle = self._outstanding.pop(frame.seq, None)
                if frame.type != FrameType.ACK or handle is None:
                    raise TransferError(f"unexpected {frame.type.name} frame seq {frame.seq}")
                error = None if frame.status == WireStatus.OK else status_error(frame.status, frame.length)
                self._shared.tracker.part_done(handle, error)
            self._break(PeerLostError(f"peer {self._peer} closed the connection"))
        except (OSError, KVTransferError) as exc:
            self._break(PeerLostError(f"peer {self._peer}: {exc}"))

    def _break(self, error: KVTransferError) -> None:
        with self._lock:
            self.broken = self.broken or error
            outstanding, self._outstanding = list(self._outstanding.values()), {}
        for handle in outstanding:
            self._shared.tracker.part_done(handle, error)

    def close(self, timeout_s: float) -> None:
        """Send BYE after queued work, wait for its acks, then tear the socket down."""
        self._queue.put(None)
        self._tx.join(timeout_s)
        self._ack.join(timeout_s)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._tx.join(timeout_s)
        self._ack.join(timeout_s)
        self.sock.close()


@dataclass(slots=True)
class OutboundPeer:
    info: EndpointInfo
    streams: list[OutboundStream]


def split_by_bytes(ops: Sequence[WriteOp], parts: int) -> list[list[WriteOp]]:
    """Deal ``ops`` over ``parts`` lists, each op to the currently lightest list (stable)."""
    buckets: list[list[WriteOp]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for op in ops:
        i = loads.index(min(loads))
        buckets[i].append(op)
        loads[i] += op.length
    return [b for b in buckets if b]


class SoftwareEngine(TransferEngine):
    """Base of tcp and shm: memory table, peers, tracker, threads. Subclasses supply the
    transport: :meth:`_transport` (what ``describe`` advertises) and :meth:`_open_peer`."""

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
        self._closed = False
        self._listener: Listener | None = None

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

    def register_memory(self, memory: Memory, *, shared: object | None = None) -> MemoryRegion:
        self._check_open()
        return self._s.memory.register(memory, shared).region

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._s.memory.deregister(region.key)

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
        local_lengths: dict[int, int] = {}
        for op in ops:
            length = local_lengths.get(op.local.key)
            if length is None:
                reg = self._s.memory.get(op.local.key)
                if reg is None:
                    raise RemoteAccessError(f"local region key {op.local.key:#x} is not registered")
                length = local_lengths[op.local.key] = reg.region.length
            if op.local_offset < 0 or op.length <= 0 or op.local_offset + op.length > length:
                check_bounds(self._s.memory.get(op.local.key).region, op.local_offset, op.length)
        nbytes = sum(op.length for op in ops)
        rejected = self._check_remote(state, ops)
        if rejected is not None:
            self._s.counters.add(writes_rejected=len(ops))
            handle = self._s.tracker.new(peer, 1, len(ops), nbytes)
            self._s.tracker.fail(handle, rejected)
            return handle
        live = [s for s in state.streams if s.broken is None]
        if not live:
            raise PeerLostError(f"peer {peer} is lost")
        parts = split_by_bytes(ops, len(live))
        handle = self._s.tracker.new(peer, len(parts), len(ops), nbytes)
        self._s.counters.add(writes_posted=len(ops), bytes_posted=nbytes)
        for stream, part in zip(live, parts):
            stream.submit(handle, part)
        return handle

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

    # -- helpers for subclasses -----------------------------------------------------------------
    def _start_listener(self, sock: socket.socket) -> None:
        self._listener = Listener(sock, f"kv-{self.name}-listen", self._threads, self._accept)

    def _accept(self, sock: socket.socket) -> None:
        conn = self._serve_connection(sock)
        with self._lock:
            if self._closed:
                sock.close()
                return
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
