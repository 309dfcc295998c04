"""The verbs engine's writer side: one outbound peer per receiver, its bootstrap connection, its
QPs and the RDMA WRITE WITH IMMEDIATE posts.

Lifecycle of a writer's peer (``connect`` .. ``disconnect``)::

    connect: TCP + auth + QP exchange; returns once our QPs are at RTS and the receiver's were
             at RTR before it answered, so the first write cannot arrive too early.
    CONNECTED --error completion / failed post / QP async error--> RECONNECTING: the QPs are
             torn down (flushed, drained, destroyed; in-flight handles fail), new ones are
             exchanged over the bootstrap connection, CONNECTED again. Posts made meanwhile wait.
    --receiver gone (bootstrap EOF) or reconnect failed--> LOST: handles fail with
             PeerLostError; post_writes raises it.
    disconnect: no new posts; wait (``close_timeout_s``) for posted writes; BYE; tear down.

Threads: ``kv-verbs-reconnect-<peer>`` (one per reset); the bootstrap connection is read by the
engine's ``kv-verbs-peers`` watch. One lock guards the peer table and every peer's state.
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

from kvtransfer.base import PeerId, WriteHandle, WriteOp
from kvtransfer.config import EngineConfig
from kvtransfer.connection import Shared, ThreadGroup
from kvtransfer.endpoint import EndpointInfo, TransportKind
from kvtransfer.errors import AuthError, KVTransferError, PeerLostError, TransferError
from kvtransfer.verbs.bootstrap import SocketWatch, read_qp_list, writer_handshake
from kvtransfer.verbs.cq import CompletionLoop, QueuedWrite
from kvtransfer.verbs.links import QpLinks
from kvtransfer.verbs.memory import MemoryTable
from kvtransfer.verbs.qp import RcQp
from kvtransfer.verbs.support import MSG_BYE, MSG_RECONNECT, MSG_RECONNECTED, pack_qp_list, write_with_imm

log = logging.getLogger(__name__)


class PeerState(IntEnum):
    CONNECTED = 0
    RECONNECTING = 1
    CLOSING = 2
    LOST = 3


@dataclass(eq=False)
class OutboundPeer:
    peer_id: PeerId
    info: EndpointInfo
    sock: socket.socket
    remote_addr: dict[int, int]
    state: PeerState = PeerState.CONNECTED
    error: KVTransferError | None = None
    replies: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class Writers:
    """Every outbound peer of one engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, shared: Shared, memory: MemoryTable, links: QpLinks,
                 loop: CompletionLoop, watch: SocketWatch, threads: ThreadGroup,
                 ids: itertools.count) -> None:
        self._cfg, self._v, self._s = config, config.verbs, shared
        self._mem, self._links, self._loop, self._watch, self._threads = memory, links, loop, watch, threads
        self._ids = ids
        self._lock = threading.Lock()
        self._peers: dict[PeerId, OutboundPeer] = {}
        self._by_endpoint: dict[str, PeerId] = {}
        self._closed = False

    def connect(self, peer: EndpointInfo) -> PeerId:
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
            qps = self._links.new(peer_id, self._v.qps_per_peer)
            writer_handshake(sock, self._cfg.secret, self._s.endpoint_id, self._links.infos(qps),
                             lambda remote: self._links.connect(qps, remote))
        except (AuthError, TransferError, OSError) as exc:
            self._loop.teardown(peer_id, PeerLostError("connect failed")).wait(self._cfg.close_timeout_s)
            self._links.discard_unconnected(qps)
            sock.close()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"verbs bootstrap with {addr.host}:{addr.port} failed: {exc}") from exc
        state = OutboundPeer(peer_id, peer, sock, {r.key: r.addr for r in peer.regions})
        with self._lock:
            self._peers[peer_id] = state
            self._by_endpoint[peer.endpoint_id] = peer_id
        self._watch.watch(sock, lambda s, kind: self._message(state, kind),
                          lambda s, error: self._eof(state, error))
        return peer_id

    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        state = self._outbound(peer)
        writes, nbytes = [], 0
        for op, local in zip(ops, self._mem.sources(ops), strict=True):
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

    def _outbound(self, peer: PeerId) -> OutboundPeer:
        with self._lock:
            state = self._peers.get(peer)
        if state is None:
            raise TransferError(f"unknown peer {peer}")
        if state.state == PeerState.LOST:
            raise PeerLostError(f"peer {peer} is lost: {state.error}")
        if state.state == PeerState.CLOSING:
            raise TransferError(f"peer {peer} is disconnecting")
        return state

    def on_broken(self, owner: str, error: KVTransferError) -> None:
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

    def _reconnect(self, state: OutboundPeer) -> None:
        qps: list[RcQp] = []
        try:
            qps = self._links.new(state.peer_id, self._v.qps_per_peer)
            with state.send_lock:
                state.sock.sendall(pack_qp_list(MSG_RECONNECT, self._links.infos(qps)))
            reply = state.replies.get(timeout=self._cfg.connect_timeout_s)
            if isinstance(reply, Exception):
                raise reply
            self._links.connect(qps, reply, at_rts=lambda: self._reconnected(state))
            log.info("verbs: reconnected to %s", state.peer_id)
        except (queue.Empty, KVTransferError, OSError) as exc:
            self._links.discard_unconnected(qps)
            self._lose(state, PeerLostError(f"reconnecting to {state.peer_id} failed: {exc!r}"))

    def _reconnected(self, state: OutboundPeer) -> None:
        """A reconnecting peer is CONNECTED again before its QPs can carry (and fail) a write, so
        a failure right after the reconnect starts the next one instead of being dropped."""
        with self._lock:
            if state.state == PeerState.RECONNECTING:
                state.state = PeerState.CONNECTED

    def _message(self, state: OutboundPeer, kind: bytes) -> None:
        if kind != MSG_RECONNECTED:
            raise TransferError(f"unexpected bootstrap message {kind!r} from the receiver")
        state.replies.put(read_qp_list(state.sock))

    def _eof(self, state: OutboundPeer, error: Exception | None) -> None:
        state.replies.put(PeerLostError("the receiver closed the bootstrap connection"))
        if state.state != PeerState.CLOSING:
            self._lose(state, PeerLostError(f"receiver of {state.peer_id} is gone ({error or 'EOF'})"))

    def _lose(self, state: OutboundPeer, error: KVTransferError) -> None:
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

    def close(self) -> None:
        """No more resets; disconnect every peer."""
        with self._lock:
            self._closed = True
            peers = list(self._peers)
        for peer in peers:
            self.disconnect(peer)
