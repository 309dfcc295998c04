"""Shared-secret mutual authentication of a stream socket (HMAC-SHA256 challenge-response).

Exchange (client = writer, server = receiver)::

    C -> S  HELLO     magic "PDKVAUTH", version u16, client_nonce[32], id_len u16, client_id
    S -> C  CHALLENGE magic, version, server_nonce[32], HMAC(secret, "server" | cn | sn)
    C -> S  PROOF     HMAC(secret, "client" | sn | cn | client_id)
    S -> C  RESULT    u8: 0 accepted, 1 rejected

Both sides prove knowledge of the secret without sending it; fresh nonces defeat replay. Every
failure raises ``AuthError``; the caller closes the socket. Runs under the socket's timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from kvtransfer.errors import AuthError, PeerLostError
from kvtransfer.frame import recv_exact

_MAGIC = b"PDKVAUTH"
_VERSION = 1
_HELLO = struct.Struct("!8sH32sH")
_CHALLENGE = struct.Struct("!8sH32s32s")
_MAC_SIZE = 32
_MAX_ID = 1024


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    try:
        if not recv_exact(sock, memoryview(buf)):
            raise AuthError("peer closed the connection during the handshake")
    except (PeerLostError, OSError) as exc:
        raise AuthError(f"handshake failed: {exc}") from exc
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes, client_id: str) -> None:
    """Authenticate to the server and verify it; ``AuthError`` on any mismatch."""
    ident = client_id.encode()
    cn = os.urandom(32)
    sock.sendall(_HELLO.pack(_MAGIC, _VERSION, cn, len(ident)) + ident)
    magic, version, sn, server_mac = _CHALLENGE.unpack(_read(sock, _CHALLENGE.size))
    if magic != _MAGIC or version != _VERSION:
        raise AuthError(f"peer speaks another protocol (magic {magic!r}, version {version})")
    if not hmac.compare_digest(server_mac, _mac(secret, b"server", cn, sn)):
        raise AuthError("peer failed to prove the shared secret")
    sock.sendall(_mac(secret, b"client", sn, cn, ident))
    if _read(sock, 1) != b"\x00":
        raise AuthError("peer rejected our credentials")


def server_handshake(sock: socket.socket, secret: bytes) -> str:
    """Verify a connecting client; returns its id. ``AuthError`` on any mismatch."""
    magic, version, cn, id_len = _HELLO.unpack(_read(sock, _HELLO.size))
    if magic != _MAGIC or version != _VERSION or id_len > _MAX_ID:
        raise AuthError("connection did not start with a valid handshake")
    ident = _read(sock, id_len)
    sn = os.urandom(32)
    sock.sendall(_CHALLENGE.pack(_MAGIC, _VERSION, sn, _mac(secret, b"server", cn, sn)))
    proof = _read(sock, _MAC_SIZE)
    ok = hmac.compare_digest(proof, _mac(secret, b"client", sn, cn, ident))
    sock.sendall(b"\x00" if ok else b"\x01")
    if not ok:
        raise AuthError("peer failed to prove the shared secret")
    return ident.decode(errors="replace")
