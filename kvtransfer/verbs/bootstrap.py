"""The verbs engine's bootstrap connection: a TCP connection per writer/receiver pair that
authenticates the peer, exchanges QP records, then stays open as the liveness and control
channel (message formats in :mod:`kvtransfer.verbs.support`).

Handshakes (run under the socket's timeout, ``connect_timeout_s``):

- :func:`writer_handshake`: auth (client), HELLO + our QpInfos, wait for the receiver's HELLO
  (sent only once its QPs are at RTR), let the caller connect our QPs, send READY.
- :func:`receiver_handshake`: auth (server), read HELLO + the writer's QpInfos, let the caller
  create and connect QPs, answer HELLO, wait for READY.

After that, :class:`SocketWatch` (thread ``kv-verbs-peers``) watches every bootstrap socket of
the engine with one ``select``: it reads each control message as it arrives and reports EOF.
Closing a watched socket from another thread: ``shutdown()`` it; the watch sees EOF and closes.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable, Sequence

from kvtransfer import auth
from kvtransfer.connection import ThreadGroup
from kvtransfer.errors import PeerLostError, TransferError
from kvtransfer.frame import recv_exact
from kvtransfer.verbs.support import (COUNT, HELLO, MAX_QPS_PER_PEER, MSG_READY, QP_INFO_SIZE, QpInfo, pack_hello,
                                      unpack_hello)


def read_bytes(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ``PeerLostError`` on EOF."""
    buf = bytearray(n)
    if n and not recv_exact(sock, memoryview(buf)):
        raise PeerLostError("the bootstrap connection closed")
    return bytes(buf)


def read_infos(sock: socket.socket, count: int) -> list[QpInfo]:
    data = read_bytes(sock, count * QP_INFO_SIZE)
    return [QpInfo.from_bytes(data[i * QP_INFO_SIZE:(i + 1) * QP_INFO_SIZE]) for i in range(count)]


def read_qp_list(sock: socket.socket) -> list[QpInfo]:
    """The ``n + n QpInfo`` body of RECONNECT / RECONNECTED."""
    (count,) = COUNT.unpack(read_bytes(sock, COUNT.size))
    if not 1 <= count <= MAX_QPS_PER_PEER:
        raise TransferError(f"verbs bootstrap: {count} QPs in a reconnect")
    return read_infos(sock, count)


def writer_handshake(sock: socket.socket, secret: bytes, endpoint_id: str, ours: Sequence[QpInfo],
                     connect: Callable[[list[QpInfo]], None]) -> None:
    """Writer side (see the module docstring). ``connect(remote_infos)`` moves our QPs to RTS.
    Raises ``AuthError``, ``TransferError`` (``PeerLostError`` on EOF), ``OSError``."""
    auth.client_handshake(sock, secret, endpoint_id)
    sock.sendall(pack_hello(ours))
    count = unpack_hello(read_bytes(sock, HELLO.size))
    if count != len(ours):
        raise TransferError(f"verbs bootstrap: the receiver made {count} QPs, we asked for {len(ours)}")
    connect(read_infos(sock, count))
    sock.sendall(MSG_READY)


def receiver_handshake(sock: socket.socket, secret: bytes,
                       accept: Callable[[str, list[QpInfo]], list[QpInfo]]) -> str:
    """Receiver side (see the module docstring). ``accept(source, writer_infos)`` creates and
    connects our QPs (to RTR at least) and returns their records. Returns the writer's endpoint
    id. Raises ``AuthError``, ``TransferError``, ``OSError``."""
    source = auth.server_handshake(sock, secret)
    infos = read_infos(sock, unpack_hello(read_bytes(sock, HELLO.size)))
    sock.sendall(pack_hello(accept(source, infos)))
    if read_bytes(sock, 1) != MSG_READY:
        raise TransferError("verbs bootstrap: the writer did not confirm its QPs")
    return source


class SocketWatch:
    """One thread watching many bootstrap sockets (see the module docstring).

    ``watch(sock, on_message, on_eof)``: ``on_message(sock, kind_byte)`` is called on the watch
    thread when a message starts (it reads the rest itself, under the socket's timeout);
    ``on_eof(sock, error)`` once when the socket ends (EOF, reset, or a handler's error), after
    which the socket is closed. Handlers must not block for long.
    """

    def __init__(self, threads: ThreadGroup, name: str, read_timeout_s: float) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._timeout = read_timeout_s
        self._thread = threads.start(name, self._run)

    def watch(self, sock: socket.socket, on_message: Callable[[socket.socket, bytes], None],
              on_eof: Callable[[socket.socket, Exception | None], None]) -> None:
        sock.settimeout(self._timeout)
        with self._lock:
            self._sel.register(sock, selectors.EVENT_READ, (on_message, on_eof))
        self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select():
                if key.fileobj is self._wake_r:
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    continue
                self._serve(key.fileobj, *key.data)
        with self._lock:
            leftover = [k for k in self._sel.get_map().values() if k.fileobj is not self._wake_r]
        for key in leftover:
            self._end(key.fileobj, key.data[1], None)

    def _serve(self, sock: socket.socket, on_message, on_eof) -> None:
        try:
            kind = sock.recv(1)
            if not kind:
                self._end(sock, on_eof, None)
                return
            on_message(sock, kind)
        except Exception as exc:   # noqa: BLE001 - reset, timeout, protocol error: the peer ends
            self._end(sock, on_eof, exc)

    def _end(self, sock: socket.socket, on_eof, error: Exception | None) -> None:
        with self._lock:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                return
        try:
            on_eof(sock, error)
        finally:
            sock.close()

    def close(self) -> None:
        """Stop the thread (the engine joins it); sockets still watched get ``on_eof``."""
        self._stop.set()
        self._wake_w.send(b"x")

    def close_fds(self) -> None:
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
