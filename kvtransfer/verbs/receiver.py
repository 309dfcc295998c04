"""The verbs engine's receiver side: the inbound connections of the writers that write into
this engine's memory.

A receiver's inbound connection: the handshake on a short-lived ``kv-verbs-accept-<n>`` thread,
then watched by ``kv-verbs-peers``. BYE: its QPs are torn down. EOF without BYE (the writer
died): its QPs are destroyed first, the immediates they delivered are dispatched, and only then
``arrivals.on_peer_lost`` fires - once it has, nothing of that writer can land any more, so its
blocks may be reused. A RECONNECT replaces its QPs. Each connection is counted in
`PeerConnections` from its handshake until its QPs are gone (the writer's last:
``arrivals.on_peer_gone``).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from dataclasses import dataclass

from kvtransfer.config import EngineConfig
from kvtransfer.connection import Shared, ThreadGroup
from kvtransfer.errors import KVTransferError, PeerLostError, TransferError
from kvtransfer.verbs.bootstrap import SocketWatch, read_qp_list, receiver_handshake
from kvtransfer.verbs.cq import CompletionLoop
from kvtransfer.verbs.links import QpLinks
from kvtransfer.verbs.support import MSG_BYE, MSG_RECONNECT, MSG_RECONNECTED, QpInfo, pack_qp_list

log = logging.getLogger(__name__)


@dataclass(eq=False)
class InboundConn:
    owner: str
    source: str
    sock: socket.socket
    closing: bool = False


class Receivers:
    """Every inbound connection of one engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, shared: Shared, links: QpLinks, loop: CompletionLoop,
                 watch: SocketWatch, threads: ThreadGroup, ids: itertools.count) -> None:
        self._cfg, self._s = config, shared
        self._links, self._loop, self._watch, self._threads = links, loop, watch, threads
        self._ids = ids
        self._lock = threading.Lock()
        self._inbound: dict[str, InboundConn] = {}
        self._handshaking: set[socket.socket] = set()
        self._closed = False

    def accept(self, sock: socket.socket) -> None:
        """Listener thread: a writer connected; handshake on a thread of its own."""
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
        conn: InboundConn | None = None

        def accept(source: str, remote: list[QpInfo]) -> list[QpInfo]:
            nonlocal conn
            conn = InboundConn(owner, source, sock)
            qps = self._links.new(owner, len(remote))
            try:
                self._links.connect(qps, remote, inbound_source=source)
            except BaseException:
                self._links.discard_unconnected(qps)
                raise
            return self._links.infos(qps)

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
                self._s.peers.opened(owner, conn.source)
        if closed:
            self._loop.teardown(owner, PeerLostError("engine closed"))
            sock.close()
            return
        self._watch.watch(sock, lambda s, kind: self._message(conn, kind),
                          lambda s, error: self._eof(conn, error))

    def _message(self, conn: InboundConn, kind: bytes) -> None:
        if kind == MSG_BYE:
            conn.closing = True
            return
        if kind != MSG_RECONNECT:
            raise TransferError(f"unexpected bootstrap message {kind!r} from writer {conn.source}")
        remote = read_qp_list(conn.sock)
        self._loop.teardown(conn.owner, PeerLostError("replaced")).wait(self._cfg.close_timeout_s)
        qps = self._links.new(conn.owner, len(remote))
        self._links.connect(qps, remote, inbound_source=conn.source)
        conn.sock.sendall(pack_qp_list(MSG_RECONNECTED, self._links.infos(qps)))

    def _eof(self, conn: InboundConn, error: Exception | None) -> None:
        with self._lock:
            self._inbound.pop(conn.owner, None)
        if conn.closing:
            self._loop.teardown(conn.owner, PeerLostError("writer disconnected"),
                                then=lambda: self._s.peers.ended(conn.owner))
            return
        lost = PeerLostError(f"writer {conn.source}: bootstrap connection ended ({error or 'EOF'})")

        def report() -> None:
            self._s.counters.add(peers_lost=1)
            self._s.arrivals.on_peer_lost(conn.source, lost)
            self._s.peers.ended(conn.owner)

        self._loop.teardown(conn.owner, lost, then=report)

    def refuse_new(self) -> None:
        """Handshakes that complete from now on are torn down instead of kept."""
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Cut the handshakes in progress and every inbound connection; wait for their QPs."""
        with self._lock:
            self._closed = True
            handshaking = list(self._handshaking)
            inbound = list(self._inbound.values())
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
            if self._loop.teardown(conn.owner, PeerLostError("engine closed")).wait(self._cfg.close_timeout_s):
                self._s.peers.ended(conn.owner)
