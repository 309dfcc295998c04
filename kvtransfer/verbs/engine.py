"""``verbs``: RDMA WRITE WITH IMMEDIATE over RC queue pairs (pyverbs, lazily imported).

Pieces: :mod:`~kvtransfer.verbs.device` (context, PD, CQ, SRQ, port and GID),
:mod:`~kvtransfer.verbs.qp` (one QP's states), :mod:`~kvtransfer.verbs.cq` (the completion
loop: CQ, budget, teardown), :mod:`~kvtransfer.verbs.bootstrap` (handshakes, the socket watch),
:mod:`~kvtransfer.verbs.gpu` (CUDA registration and flush), :mod:`~kvtransfer.verbs.compat`
(pyverbs releases). This module is the engine: memory, peers, posting, the contract.

Lifecycle of a writer's peer (``connect`` .. ``disconnect``)::

    connect: TCP + auth + QP exchange; returns once our QPs are at RTS and the receiver's were
             at RTR before it answered, so the first write cannot arrive too early.
    CONNECTED --error completion / failed post / QP async error--> RECONNECTING: the QPs are
             torn down (flushed, drained, destroyed; in-flight handles fail), new ones are
             exchanged over the bootstrap connection, CONNECTED again. Posts made meanwhile wait.
    --receiver gone (bootstrap EOF) or reconnect failed--> LOST: handles fail with
             PeerLostError; post_writes raises it.
    disconnect: no new posts; wait (``close_timeout_s``) for posted writes; BYE; tear down.

A receiver's inbound connection: the handshake on a short-lived ``kv-verbs-accept-<n>`` thread,
then watched by ``kv-verbs-peers``. BYE: its QPs are torn down. EOF without BYE (the writer
died): its QPs are destroyed first, the immediates they delivered are dispatched, and only then
``arrivals.on_peer_lost`` fires - once it has, nothing of that writer can land any more, so its
blocks may be reused. A RECONNECT replaces its QPs.

Threads: ``kv-verbs-listen``, ``kv-verbs-accept-<n>``, ``kv-verbs-peers``, ``kv-verbs-cq``,
``kv-verbs-reconnect-<peer>``; all stopped and joined by ``close()``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from kvtransfer.base import ArrivalHandler, EngineStats, Memory, PeerId, TransferEngine, WriteCompletion, WriteHandle, WriteOp
from kvtransfer.config import EngineConfig
from kvtransfer.connection import Listener, Shared, ThreadGroup
from kvtransfer.endpoint import EndpointInfo, MemoryRegion, TransportAddress, TransportKind, local_host_id
from kvtransfer.errors import (AuthError, KVTransferError, PeerLostError,
                               RemoteAccessError, TransferError)
from kvtransfer.verbs.bootstrap import SocketWatch, read_qp_list, receiver_handshake, writer_handshake
from kvtransfer.verbs.cq import CompletionLoop, QueuedWrite
from kvtransfer.verbs.device import Device
from kvtransfer.verbs.qp import QpState, RcQp, connect_qp, create_qp, destroy, local_info
from kvtransfer.verbs.support import (IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, MSG_BYE, MSG_RECONNECT,
                                      MSG_RECONNECTED, bytes_to_gid, gid_to_bytes, pack_qp_list,
                                      rdma_device_available, write_with_imm)

__all__ = ["VerbsEngine", "rdma_device_available", "gid_to_bytes", "bytes_to_gid"]
log = logging.getLogger(__name__)
_ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE


class PeerState(IntEnum):
    CONNECTED = 0
    RECONNECTING = 1
    CLOSING = 2
    LOST = 3


@dataclass(eq=False)
class _Outbound:
    peer_id: PeerId
    info: EndpointInfo
    sock: socket.socket
    remote_addr: dict[int, int]
    state: PeerState = PeerState.CONNECTED
    error: KVTransferError | None = None
    replies: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    send_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class _Inbound:
    owner: str
    source: str
    sock: socket.socket
    closing: bool = False


@dataclass(frozen=True, slots=True)
class _Mr:
    mr: object
    region: MemoryRegion
    lkey: int
    cuda: torch.device | None = None


class VerbsEngine(TransferEngine):
    """RDMA engine; see the module docstring and :class:`TransferEngine` for the contracts.

    Raises from the constructor: ``EngineUnavailableError`` (no pyverbs), ``NoRdmaDeviceError``
    (no device, the named device is absent, its port is not ACTIVE, its GID table is empty),
    ``TransferError`` (the bootstrap listener cannot bind).
    """

    name = "verbs"

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        self._s = shared if shared is not None else Shared.create(config, arrivals)
        self._cfg = config
        self._v = config.verbs
        self._dev = Device(self._v)
        self._lock = threading.Lock()
        self._mrs: dict[int, _Mr] = {}
        self._peers: dict[PeerId, _Outbound] = {}
        self._by_endpoint: dict[str, PeerId] = {}
        self._inbound: dict[str, _Inbound] = {}
        self._ids = itertools.count(1)
        self._handshaking: set[socket.socket] = set()
        self._closed = False
        self._threads = ThreadGroup()
        self._loop: CompletionLoop | None = None
        self._watch: SocketWatch | None = None
        self._listener: Listener | None = None
        try:
            self._loop = CompletionLoop(self._dev, self._s, self._v, self._threads, self._on_broken,
                                        config.close_timeout_s)
            self._watch = SocketWatch(self._threads, "kv-verbs-peers", config.connect_timeout_s)
            try:
                sock = socket.create_server((config.bind_host, config.port))
            except OSError as exc:
                raise TransferError(f"cannot listen on {config.bind_host}:{config.port}: {exc}") from exc
            self._port = sock.getsockname()[1]
            self._listener = Listener(sock, "kv-verbs-listen", self._threads, self._accept)
        except BaseException:
            self._stop_threads()
            self._dev.close()
            raise
        port = self._dev.port
        log.info("verbs engine on %s port %d: GID index %s (%s), active MTU %d", self._dev.name, port.port,
                 port.gid_index, port.gid_reason, port.active_mtu)

    @property
    def device(self) -> Device:
        """The opened device (name, port info, chosen GID)."""
        return self._dev

    # -- memory ---------------------------------------------------------------------------------
    def register_memory(self, memory: Memory, *, shared: object | None = None) -> MemoryRegion:
        """Host memory: ``ibv_reg_mr`` (also entered in the shared memory table, so shm in
        ``auto`` sees it). CUDA memory: dma-buf, else nvidia-peermem
        (:func:`kvtransfer.verbs.gpu.register_cuda`; the region's ``addr`` is then the MR's
        iova). Raises ``TransferError`` (``GpuRegistrationError`` for CUDA memory)."""
        self._check_open()
        if isinstance(memory, torch.Tensor) and not memory.is_contiguous():
            raise TransferError("registered tensors must be contiguous")
        if isinstance(memory, torch.Tensor) and memory.device.type == "cuda":
            from kvtransfer.verbs.gpu import register_cuda
            reg = register_cuda(self._dev.pd, memory, _ACCESS)
            length = memory.numel() * memory.element_size()
            entry = _Mr(reg.mr, MemoryRegion(reg.iova, length, int(reg.mr.rkey)), int(reg.mr.lkey), memory.device)
        else:
            entry = self._register_host(memory)
            try:
                self._s.memory.register(memory, shared, key=entry.region.key)
            except BaseException:
                entry.mr.close()
                raise
        with self._lock:
            self._mrs[entry.region.key] = entry
        return entry.region

    def _register_host(self, memory: Memory) -> _Mr:
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError

        if isinstance(memory, torch.Tensor):
            if memory.device.type != "cpu":
                raise TransferError(f"the verbs engine cannot register {memory.device} memory")
            addr, length = memory.data_ptr(), memory.numel() * memory.element_size()
        else:
            addr, length = memory
        if length <= 0 or addr <= 0:
            raise TransferError(f"cannot register an empty or null range ({addr:#x}, {length})")
        try:
            mr = MR(self._dev.pd, length, _ACCESS, address=addr)
        except PyverbsError as exc:
            raise TransferError(f"ibv_reg_mr of {length} bytes failed: {exc} (is the memlock limit high "
                                "enough? ulimit -l, or docker --ulimit memlock=-1)") from exc
        return _Mr(mr, MemoryRegion(addr, length, int(mr.rkey)), int(mr.lkey))

    def deregister_memory(self, region: MemoryRegion) -> None:
        with self._lock:
            entry = self._mrs.pop(region.key, None)
        self._s.memory.deregister(region.key)
        if entry is not None:
            entry.mr.close()

    def describe(self) -> EndpointInfo:
        with self._lock:
            regions = tuple(m.region for m in self._mrs.values())
        addr = TransportAddress(TransportKind.VERBS, host=self._cfg.host_for_peers, port=self._port)
        return EndpointInfo(self._s.endpoint_id, local_host_id(), regions, (addr,))

    def flush_arrivals(self) -> None:
        """After a slot's count completed on a CUDA region: ``cuFlushGPUDirectRDMAWrites`` on each
        CUDA device with a registered region, so kernels launched next read the written bytes.
        Nothing to do for host memory. Raises ``GpuRegistrationError`` if the driver refuses."""
        with self._lock:
            devices = {m.cuda for m in self._mrs.values() if m.cuda is not None}
        if devices:
            from kvtransfer.verbs.gpu import flush_gpudirect_writes
            for device in devices:
                flush_gpudirect_writes(device)

    # -- QPs --------------------------------------------------------------------------------------
    def _new_qps(self, owner: str, count: int) -> list[RcQp]:
        qps: list[RcQp] = []
        try:
            for _ in range(count):
                qps.append(create_qp(self._dev.pd, self._dev.cq, self._dev.srq, self._v, owner))
        except BaseException:
            for rc in qps:
                destroy(rc)
            raise
        return qps

    def _infos(self, qps: list[RcQp]) -> list:
        port = self._dev.port
        mtu = min(self._v.mtu, port.active_mtu)
        return [local_info(rc, self._dev.gid, port.lid, mtu) for rc in qps]

    def _connect_all(self, qps: list[RcQp], remote: list, inbound_source: str | None = None,
                     state: "_Outbound | None" = None) -> None:
        """Drive ``qps`` to RTS towards ``remote``, then hand them to the completion loop. A
        reconnecting peer is CONNECTED again before its QPs can carry (and fail) a write, so a
        failure right after the reconnect starts the next one instead of being dropped."""
        port = self._dev.port
        for rc, info in zip(qps, remote, strict=True):
            connect_qp(rc, info, self._v, port.gid_index, port.active_mtu)
        if state is not None:
            with self._lock:
                if state.state == PeerState.RECONNECTING:
                    state.state = PeerState.CONNECTED
        for rc in qps:
            self._loop.add(rc, inbound_source)

    # -- writer ---------------------------------------------------------------------------------
    def connect(self, peer: EndpointInfo) -> PeerId:
        self._check_open()
        with self._lock:
            existing = self._by_endpoint.get(peer.endpoint_id)
            if existing is not None and self._peers[existing].state != PeerState.LOST:
                return existing
        addr = peer.transport(TransportKind.VERBS)
        if addr is None:
            raise TransferError(f"peer {peer.endpoint_id} offers no verbs transport")
        peer_id = PeerId(f"verbs:{next(self._ids)}")
        try:
            sock = socket.create_connection((addr.host, addr.port), timeout=self._cfg.connect_timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot reach {addr.host}:{addr.port}: {exc}") from exc
        qps: list[RcQp] = []
        try:
            qps = self._new_qps(peer_id, self._v.qps_per_peer)
            writer_handshake(sock, self._cfg.secret, self._s.endpoint_id, self._infos(qps),
                             lambda remote: self._connect_all(qps, remote))
        except (AuthError, TransferError, OSError) as exc:
            self._loop.teardown(peer_id, PeerLostError("connect failed")).wait(self._cfg.close_timeout_s)
            for rc in qps:
                if rc.state == QpState.CONNECTING:
                    destroy(rc)
            sock.close()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"verbs bootstrap with {addr.host}:{addr.port} failed: {exc}") from exc
        state = _Outbound(peer_id, peer, sock, {r.key: r.addr for r in peer.regions})
        with self._lock:
            self._peers[peer_id] = state
            self._by_endpoint[peer.endpoint_id] = peer_id
        self._watch.watch(sock, lambda s, kind: self._outbound_message(state, kind),
                          lambda s, error: self._outbound_eof(state, error))
        return peer_id

    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        state = self._outbound(peer)
        writes, nbytes = [], 0
        with self._lock:
            mrs = self._mrs
            for op in ops:
                local = mrs.get(op.local.key)
                if local is None:
                    raise RemoteAccessError(f"local region key {op.local.key:#x} is not registered")
                if op.local_offset < 0 or op.length <= 0 or op.local_offset + op.length > local.region.length:
                    raise RemoteAccessError(f"local range [{op.local_offset}, {op.local_offset + op.length}) "
                                            f"outside the region of {local.region.length} bytes")
                # An unknown remote key is posted at base 0: the receiving NIC rejects it.
                remote = state.remote_addr.get(op.remote_key, 0) + op.remote_offset
                writes.append(write_with_imm(0, local.region.addr + op.local_offset, op.length, local.lkey,
                                             remote, op.remote_key, op.imm))
                nbytes += op.length
        handle = self._s.tracker.new(peer, len(ops), len(ops), nbytes)
        if ops:
            self._s.counters.add(writes_posted=len(ops), bytes_posted=nbytes)
            self._loop.submit(peer, [QueuedWrite(w, handle) for w in writes])
        return handle

    def _outbound(self, peer: PeerId) -> _Outbound:
        with self._lock:
            state = self._peers.get(peer)
        if state is None:
            raise TransferError(f"unknown peer {peer}")
        if state.state == PeerState.LOST:
            raise PeerLostError(f"peer {peer} is lost: {state.error}")
        if state.state == PeerState.CLOSING:
            raise TransferError(f"peer {peer} is disconnecting")
        return state

    def _on_broken(self, owner: str, error: KVTransferError) -> None:
        """Loop thread: a writer QP failed; reset the connection (see the module docstring)."""
        with self._lock:
            state = self._peers.get(PeerId(owner))
            if state is None or state.state != PeerState.CONNECTED or self._closed:
                return
            state.state = PeerState.RECONNECTING
        log.warning("verbs: connection to %s failed (%s); reconnecting", owner, error)
        reset = PeerLostError(f"connection to {owner} was reset after: {error}")
        self._loop.teardown(owner, reset, keep_backlog=True, then=lambda: self._threads.start(
            f"kv-verbs-reconnect-{owner.replace(':', '')}", self._reconnect, state))

    def _reconnect(self, state: _Outbound) -> None:
        qps: list[RcQp] = []
        try:
            qps = self._new_qps(state.peer_id, self._v.qps_per_peer)
            with state.send_lock:
                state.sock.sendall(pack_qp_list(MSG_RECONNECT, self._infos(qps)))
            reply = state.replies.get(timeout=self._cfg.connect_timeout_s)
            if isinstance(reply, Exception):
                raise reply
            self._connect_all(qps, reply, state=state)
            log.info("verbs: reconnected to %s", state.peer_id)
        except (queue.Empty, KVTransferError, OSError) as exc:
            for rc in qps:
                if rc.state == QpState.CONNECTING:
                    destroy(rc)
            self._lose(state, PeerLostError(f"reconnecting to {state.peer_id} failed: {exc!r}"))

    def _outbound_message(self, state: _Outbound, kind: bytes) -> None:
        if kind != MSG_RECONNECTED:
            raise TransferError(f"unexpected bootstrap message {kind!r} from the receiver")
        state.replies.put(read_qp_list(state.sock))

    def _outbound_eof(self, state: _Outbound, error: Exception | None) -> None:
        state.replies.put(PeerLostError("the receiver closed the bootstrap connection"))
        if state.state != PeerState.CLOSING:
            self._lose(state, PeerLostError(f"receiver of {state.peer_id} is gone ({error or 'EOF'})"))

    def _lose(self, state: _Outbound, error: KVTransferError) -> None:
        with self._lock:
            if state.state in (PeerState.LOST, PeerState.CLOSING):
                return
            state.state, state.error = PeerState.LOST, error
        self._s.counters.add(peers_lost=1)
        self._loop.teardown(state.peer_id, error)
        try:
            state.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            state = self._peers.pop(peer, None)
            if state is None:
                return
            self._by_endpoint.pop(state.info.endpoint_id, None)
            was = state.state
            state.state = PeerState.CLOSING
        timeout = self._cfg.close_timeout_s
        if was in (PeerState.CONNECTED, PeerState.RECONNECTING):
            self._loop.wait_idle(peer, timeout)
            try:
                with state.send_lock:
                    state.sock.sendall(MSG_BYE)
            except OSError:
                pass
        self._loop.teardown(peer, PeerLostError(f"disconnected from {peer}")).wait(timeout)
        try:
            state.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._s.tracker.fail_peer(peer, PeerLostError(f"disconnected from {peer}"))

    # -- receiver -------------------------------------------------------------------------------
    def _accept(self, sock: socket.socket) -> None:
        if self._closed:
            sock.close()
            return
        self._threads.start(f"kv-verbs-accept-{next(self._ids)}", self._serve_handshake, sock)

    def _serve_handshake(self, sock: socket.socket) -> None:
        owner = f"in{next(self._ids)}"
        with self._lock:
            self._handshaking.add(sock)
        try:
            self._handshake(sock, owner)
        finally:
            with self._lock:
                self._handshaking.discard(sock)

    def _handshake(self, sock: socket.socket, owner: str) -> None:
        conn: _Inbound | None = None

        def accept(source: str, remote: list) -> list:
            nonlocal conn
            conn = _Inbound(owner, source, sock)
            qps = self._new_qps(owner, len(remote))
            try:
                self._connect_all(qps, remote, inbound_source=source)
            except BaseException:
                for rc in qps:
                    if rc.state == QpState.CONNECTING:
                        destroy(rc)
                raise
            return self._infos(qps)

        try:
            sock.settimeout(self._cfg.connect_timeout_s)
            receiver_handshake(sock, self._cfg.secret, accept)
        except (KVTransferError, OSError) as exc:
            if conn is None:
                self._s.counters.add(auth_failures=1)
            log.info("verbs: inbound handshake failed: %s", exc)
            self._loop.teardown(owner, PeerLostError("handshake failed")).wait(self._cfg.close_timeout_s)
            sock.close()
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._inbound[owner] = conn
        if closed:
            self._loop.teardown(owner, PeerLostError("engine closed"))
            sock.close()
            return
        self._watch.watch(sock, lambda s, kind: self._inbound_message(conn, kind),
                          lambda s, error: self._inbound_eof(conn, error))

    def _inbound_message(self, conn: _Inbound, kind: bytes) -> None:
        if kind == MSG_BYE:
            conn.closing = True
            return
        if kind != MSG_RECONNECT:
            raise TransferError(f"unexpected bootstrap message {kind!r} from writer {conn.source}")
        remote = read_qp_list(conn.sock)
        self._loop.teardown(conn.owner, PeerLostError("replaced")).wait(self._cfg.close_timeout_s)
        qps = self._new_qps(conn.owner, len(remote))
        self._connect_all(qps, remote, inbound_source=conn.source)
        conn.sock.sendall(pack_qp_list(MSG_RECONNECTED, self._infos(qps)))

    def _inbound_eof(self, conn: _Inbound, error: Exception | None) -> None:
        with self._lock:
            self._inbound.pop(conn.owner, None)
        if conn.closing:
            self._loop.teardown(conn.owner, PeerLostError("writer disconnected"))
            return
        lost = PeerLostError(f"writer {conn.source}: bootstrap connection ended ({error or 'EOF'})")

        def report() -> None:
            self._s.counters.add(peers_lost=1)
            self._s.arrivals.on_peer_lost(conn.source, lost)

        self._loop.teardown(conn.owner, lost, then=report)

    # -- rest of the interface ------------------------------------------------------------------
    def poll(self) -> list[WriteCompletion]:
        return self._s.tracker.poll()

    def wait(self, handle: WriteHandle, timeout_s: float | None = None) -> WriteCompletion:
        return self._s.tracker.wait(handle, timeout_s)

    def stats(self) -> EngineStats:
        return self._s.counters.snapshot()

    def qp_states(self) -> dict[int, str]:
        """qp_num -> state of every QP not yet destroyed (tests, diagnostics)."""
        return self._loop.qp_states()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers)
            inbound = list(self._inbound.values())
        for peer in peers:
            self.disconnect(peer)
        with self._lock:
            handshaking = list(self._handshaking)
        for sock in handshaking:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in inbound:
            conn.closing = True
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in inbound:
            self._loop.teardown(conn.owner, PeerLostError("engine closed")).wait(self._cfg.close_timeout_s)
        alive = self._stop_threads()
        self._s.tracker.fail_all(TransferError("engine closed"))
        for rc in self._loop.leftover_qps():
            destroy(rc)
        with self._lock:
            mrs, self._mrs = list(self._mrs.values()), {}
        for entry in mrs:
            self._s.memory.deregister(entry.region.key)
            entry.mr.close()
        self._dev.close()
        if alive:
            raise TransferError(f"threads did not stop: {alive}")

    def _stop_threads(self) -> list[str]:
        if self._listener is not None:
            self._listener.close()
        if self._watch is not None:
            self._watch.close()
        if self._loop is not None:
            self._loop.stop()
        alive = self._threads.join_all(self._cfg.close_timeout_s)
        if self._watch is not None:
            self._watch.close_fds()
        if self._loop is not None:
            self._loop.close_fds()
        return alive

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
