"""The connections of the software engines (tcp, shm): the state an engine shares with them, the
listener, the receiver end of a writer stream (the frame loop) and the writer end (tx and ack
threads). Also used by ``verbs`` (listener, threads) and ``auto`` (shared state).

Threads (all named ``kv-<engine>-...``, all stopped by the engine's ``close()`` and joined there):

- ``kv-<e>-listen``: blocks in ``select`` on the listening socket and a wake pipe; accepts.
- ``kv-<e>-rx-<n>``: one per inbound writer connection; handshake, then blocks reading frames,
  places payloads, delivers immediates, sends acks.
- ``kv-<e>-tx-<peer>-<i>`` / ``kv-<e>-ack-<peer>-<i>``: per outbound stream; the first blocks on its
  work queue and sends, the second blocks reading acks and completes handles.
"""

from __future__ import annotations

import abc
import itertools
import logging
import queue
import selectors
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer import auth
from kvtransfer.base import ArrivalHandler, ImmediateQueue, WriteHandle, WriteOp
from kvtransfer.config import EngineConfig
from kvtransfer.endpoint import EndpointId
from kvtransfer.errors import AuthError, KVTransferError, PeerLostError, RemoteAccessError, TransferError
from kvtransfer.frame import (D_END_BATCH, DESC_SIZE, F_ACK_REQ, F_FLUSH, HEADER, HEADER_SIZE, MAGIC,
                              MAX_DESCS, T_ACK, T_BYE, VERSION, CheckedDescs, Frame, FrameType, WireStatus,
                              check_descs, imm_runs, recv_exact, recv_exact_many)
from kvtransfer.memory import MemoryTable
from kvtransfer.staging import Stager
from kvtransfer.tracker import CompletionTracker, EngineCounters

log = logging.getLogger(__name__)


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


class PeerConnections:
    """The live inbound connections of each writer to one engine (every transport of an ``auto``
    engine together), told to ``arrivals``: ``on_peer_connected`` when a writer's first one is
    up, ``on_peer_gone`` when its last one has ended - a tcp writer has ``streams_per_peer`` of
    them, and a write of one can still be landing when another ends. The callbacks run under
    this object's lock, so a writer's connected and gone reach ``arrivals`` in order."""

    def __init__(self, arrivals: ArrivalHandler) -> None:
        self._arrivals = arrivals
        self._lock = threading.Lock()
        self._source: dict[object, str] = {}   # connection -> its writer
        self._live: dict[str, int] = {}        # writer -> its live connections

    def opened(self, conn: object, source: str) -> None:
        """``conn`` (any hashable identity) from writer ``source`` is up; once per connection."""
        with self._lock:
            if conn in self._source:
                return
            self._source[conn] = source
            self._live[source] = self._live.get(source, 0) + 1
            if self._live[source] == 1:
                self._arrivals.on_peer_connected(source)

    def ended(self, conn: object) -> None:
        """``conn`` has ended: nothing of it can land any more. Idempotent; a connection never
        opened is ignored."""
        with self._lock:
            source = self._source.pop(conn, None)
            if source is None:
                return
            self._live[source] -= 1
            if self._live[source] == 0:
                del self._live[source]
                self._arrivals.on_peer_gone(source)


@dataclass(slots=True)
class Shared:
    """State shared by an engine and its connections (and by engines composed in ``auto``)."""

    config: EngineConfig
    endpoint_id: EndpointId
    memory: MemoryTable
    tracker: CompletionTracker
    counters: EngineCounters
    arrivals: ArrivalHandler
    peers: PeerConnections

    @classmethod
    def create(cls, config: EngineConfig, arrivals: ArrivalHandler | None) -> "Shared":
        arrivals = arrivals if arrivals is not None else ImmediateQueue()
        return cls(config, EndpointId(uuid.uuid4().hex), MemoryTable(), CompletionTracker(),
                   EngineCounters(), arrivals, PeerConnections(arrivals))


class Listener:
    """Accept loop on a bound, listening socket; hands each connection to ``on_accept``.

    The loop survives its errors: a failing ``on_accept`` closes that connection and is logged;
    a failing ``accept`` (out of file descriptors, say) is logged and retried after a pause, so
    the listener never dies while the worker's heartbeats say it is fine."""

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
                        self._accept_one()

    def _accept_one(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("accept failed: %s; retrying", exc)
            self._stop.wait(0.05)
            return
        try:
            self._on_accept(conn)
        except Exception:
            log.exception("could not serve an accepted connection; closed it")
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join()
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()


class InboundConnection(abc.ABC):
    """The receiver end of one writer stream: handshake, then the frame loop (:meth:`_serve`)
    until BYE; an abnormal end is reported once to ``arrivals.on_peer_lost``, and every end of an
    authenticated connection to `PeerConnections` (the writer's last: ``on_peer_gone``).
    ``after_auth(sock)`` runs once after the handshake (shm sends its fds there); descriptors are
    checked against ``table`` (default: the engine's shared memory table).

    Both software transports share the loop: read a header of type ``frame_type``, read and check
    its descriptors (:func:`~kvtransfer.frame.check_descs`; only shared regions are valid when
    ``need_shared``), let the transport place the payloads (:meth:`_place`), copy those of staged
    registrations to their device (`kvtransfer.staging`), then deliver the immediates and account
    the frame (:meth:`_account`).
    """

    frame_type: int
    need_shared: bool = False

    def __init__(self, shared: Shared, sock: socket.socket,
                 after_auth: Callable[[socket.socket], None] | None = None, table: MemoryTable | None = None) -> None:
        self.sock = sock
        self._shared, self._after_auth = shared, after_auth
        self._table = table if table is not None else shared.memory   # what descriptors are checked against
        self._acks: list[bytes] = []
        self._part_error = self._part_rejected = 0   # of the batch part in progress
        self.closing = False
        self.authenticated = False
        self.source = ""
        self._stager = Stager(shared.memory.get)   # staged (device) registrations: `kvtransfer.staging`

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
            self.authenticated = True
            self._shared.peers.opened(self, self.source)
            self.sock.settimeout(None)
            self._serve()
        except (OSError, KVTransferError) as exc:
            if not self.closing:
                self._shared.counters.add(peers_lost=1)
                self._shared.arrivals.on_peer_lost(self.source, PeerLostError(f"writer {self.source}: {exc}"))
        finally:
            self.sock.close()
            self._shared.peers.ended(self)   # after the close: no byte of it is read any more

    def _serve(self) -> None:
        """Read frames until BYE (return) or failure (raise)."""
        sock, memory = self.sock, self._table
        hdr = memoryview(bytearray(HEADER_SIZE))
        descs = memoryview(bytearray(DESC_SIZE * MAX_DESCS))
        while True:
            if not recv_exact(sock, hdr):
                raise PeerLostError("connection closed without BYE")
            magic, version, ftype, flags, _, _, _, _, count, seq = HEADER.unpack(hdr)
            if magic != MAGIC or version != VERSION:
                raise TransferError("bad frame header")
            if ftype == T_BYE:
                return
            if ftype != self.frame_type or count > MAX_DESCS:
                raise TransferError(f"unexpected frame type {ftype} / {count} descriptors")
            recv_exact_many(sock, [descs[:count * DESC_SIZE]])
            checked = check_descs(descs[:count * DESC_SIZE], memory, need_shared=self.need_shared)
            self._place(checked)
            if any(reg.home is not None for reg in checked.regs.values()):   # a device pool
                self._stager.stage_in(checked.descs, checked.status)
            self._deliver(checked.imms)
            self._account(checked, flags, seq)

    @abc.abstractmethod
    def _place(self, checked: CheckedDescs) -> None:
        """Put the frame's accepted payloads in place (and consume the rejected ones' bytes)."""

    def _deliver(self, imms: np.ndarray) -> None:
        """Hand immediates (``uint32`` array, wire order) to ``arrivals``, one call per run of equal values."""
        on_immediate, source = self._shared.arrivals.on_immediate, self.source
        for imm, count in imm_runs(imms):
            on_immediate(imm, source, count)

    def _account(self, checked: CheckedDescs, flags: int, seq: int) -> None:
        """Count one frame's writes; queue an ACK for every batch part ending in it (``seq``,
        ``seq + 1``, ...); send the queued ACKs when the frame has FLUSH (see
        :mod:`kvtransfer.frame`). A part may span frames: its rejections carry over."""
        n = len(checked.descs)
        self._shared.counters.add(writes_received=n - checked.rejected, bytes_received=checked.nbytes,
                                  writes_rejected=checked.rejected)
        ends = np.flatnonzero(checked.descs["flags"] & D_END_BATCH).tolist()
        if bool(ends) != bool(flags & F_ACK_REQ):
            raise TransferError("frame's ACK_REQ flag disagrees with its END_BATCH descriptors")
        start = 0
        for i, end in enumerate(ends + [n - 1]):
            if checked.rejected and start <= end:
                segment = checked.status[start:end + 1]
                bad = np.flatnonzero(segment)
                if len(bad):
                    self._part_error = self._part_error or int(segment[bad[0]])
                    self._part_rejected += len(bad)
            if i < len(ends):
                self._acks.append(HEADER.pack(MAGIC, VERSION, T_ACK, 0, self._part_error, 0, 0, 0,
                                              self._part_rejected, seq + i))
                self._part_error = self._part_rejected = 0
            start = end + 1
        if flags & F_FLUSH and self._acks:
            self.sock.sendall(b"".join(self._acks))
            self._acks.clear()

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

    ``send_batches(sock, batches)`` transmits batch parts ``[(ops, seq), ...]`` back to back,
    flagging each part's last frame ACK_REQ/``seq`` and the very last frame FLUSH. The tx thread
    hands it everything already queued (up to ``MERGE_BYTES``), so a writer that posts faster than
    the wire drains pays one wake-up and one ACK round trip per group rather than per batch.

    ``flush(sock)``, where given, finishes what ``send_batches`` left deferred (cuda_ipc: NOTIFY
    frames held until their copies complete, so the next group's copies are launched while the last
    group's run). The tx thread calls it whenever its queue is empty, before it blocks for more
    work, and once more before BYE; it must return with nothing deferred, even when it raises.
    """

    MERGE_BYTES = 16 << 20

    def __init__(self, sock: socket.socket, name: str, shared: Shared, peer: str, threads: ThreadGroup,
                 send_batches: Callable[[socket.socket, list[tuple[Sequence[WriteOp], int]]], None],
                 flush: Callable[[socket.socket], None] | None = None) -> None:
        self.sock, self._shared, self._peer, self._send_batches = sock, shared, peer, send_batches
        self._flush = flush
        self._queue: queue.SimpleQueue[tuple[WriteHandle, Sequence[WriteOp], int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding: dict[int, WriteHandle] = {}
        self._seq = itertools.count(1)
        self.broken: KVTransferError | None = None
        self._tx = threads.start(f"{name}-tx", self._run_tx)
        self._ack = threads.start(f"{name}-ack", self._run_ack)

    def submit(self, handle: WriteHandle, ops: Sequence[WriteOp], nbytes: int) -> None:
        self._queue.put((handle, ops, nbytes))

    def _take_group(self, first: tuple[WriteHandle, Sequence[WriteOp], int]) -> tuple[list, bool]:
        """``first`` and whatever else is queued now (up to ``MERGE_BYTES``); True once the
        stop marker was taken."""
        group, nbytes = [first], first[2]
        while nbytes < self.MERGE_BYTES:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return group, True
            group.append(item)
            nbytes += item[2]
        return group, False

    def _next(self) -> tuple[WriteHandle, Sequence[WriteOp], int] | None:
        """The next queued item, waiting for one; with a ``flush``, what was deferred is finished
        first whenever nothing is queued."""
        if self._flush is not None:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                self._finish_deferred()
        return self._queue.get()

    def _finish_deferred(self) -> None:
        try:
            self._flush(self.sock)
        except (OSError, KVTransferError) as exc:
            self._break(PeerLostError(f"send to {self._peer} failed: {exc}"))

    def _run_tx(self) -> None:
        stop = False
        while not stop and (item := self._next()) is not None:
            group, stop = self._take_group(item)
            if self.broken is not None:
                for handle, _, _ in group:
                    self._shared.tracker.part_done(handle, self.broken)
                continue
            batches = []
            with self._lock:
                for handle, ops, _ in group:
                    seq = next(self._seq)
                    self._outstanding[seq] = handle
                    batches.append((ops, seq))
            try:
                self._send_batches(self.sock, batches)
            except (OSError, KVTransferError) as exc:
                self._break(PeerLostError(f"send to {self._peer} failed: {exc}"))
        if self._flush is not None:
            self._finish_deferred()
        try:
            if self.broken is None:
                self.sock.sendall(Frame(FrameType.BYE).pack())
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _run_ack(self) -> None:
        buf = bytearray(HEADER_SIZE * 256)
        view = memoryview(buf)
        end = 0
        tracker = self._shared.tracker
        try:
            while True:
                n = self.sock.recv_into(view[end:])
                if n == 0:
                    break
                end += n
                whole = end - end % HEADER_SIZE
                done = []
                try:
                    for start in range(0, whole, HEADER_SIZE):
                        magic, version, ftype, _, status, _, _, _, rejected, seq = HEADER.unpack_from(buf, start)
                        if magic != MAGIC or version != VERSION or ftype != T_ACK:
                            raise TransferError(f"unexpected frame (type {ftype}, version {version}) on the ack stream")
                        with self._lock:
                            handle = self._outstanding.pop(seq, None)
                        if handle is None:
                            raise TransferError(f"ACK for unknown seq {seq}")
                        error = None if status == WireStatus.OK else status_error(WireStatus(status), rejected)
                        done.append((handle, error))
                finally:   # complete what was acked even when a later frame is bad
                    tracker.parts_done(done)
                view[:end - whole] = view[whole:end]
                end -= whole
            self._break(PeerLostError(f"peer {self._peer} closed the connection"))
        except (OSError, ValueError, KVTransferError) as exc:
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
