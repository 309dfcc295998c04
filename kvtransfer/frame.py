"""The fixed binary frame of the software engines (tcp payload frames, shm notices, acks).

Every frame is one 40-byte big-endian header (:data:`HEADER`)::

    magic u16 = 0x4B56 ('KV') | version u8 | type u8 | flags u16 | status u16 |
    key u32 | imm u32 | offset u64 | length u64 | seq u64

Types:
    WRITE  (writer -> receiver, tcp): ``length`` = N write descriptors follow (:data:`DESC`:
           key u32, imm u32, offset u64, length u64, flags u32), then the N payloads back to back.
           Each payload goes to ``offset`` of region ``key``; its ``imm`` is delivered after the
           payload is in place iff its descriptor has HAS_IMM. Many writes per frame let the
           receiver place them with one ``recvmsg_into`` scatter list.
    NOTIFY (writer -> receiver, shm): the writer already copied ``length`` bytes at ``offset`` of
           ``key``; no payload; the receiver checks bounds and delivers ``imm`` iff HAS_IMM.
    ACK    (receiver -> writer): answers the frame carrying flag ACK_REQ with the same ``seq``;
           ``status`` is the first :class:`WireStatus` error since the previous ACK (OK if none),
           ``length`` the number of writes rejected since then.
    BYE    (writer -> receiver): graceful end of the stream; nothing may follow.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

from kvtransfer.errors import PeerLostError, TransferError

MAGIC = 0x4B56
VERSION = 1
HEADER = struct.Struct("!HBBHHIIQQQ")
HEADER_SIZE = HEADER.size
DESC = struct.Struct("!IIQQI")
DESC_SIZE = DESC.size
MAX_DESCS = 256
IOV_BATCH = 1000  # at most IOV_MAX (1024) buffers per sendmsg / recvmsg


class FrameType(IntEnum):
    WRITE = 1
    NOTIFY = 2
    ACK = 3
    BYE = 4


class FrameFlag(IntFlag):
    NONE = 0
    HAS_IMM = 1
    ACK_REQ = 2


# Plain-int copies for hot loops (IntFlag arithmetic costs microseconds per call).
F_HAS_IMM, F_ACK_REQ = int(FrameFlag.HAS_IMM), int(FrameFlag.ACK_REQ)
T_WRITE, T_NOTIFY, T_ACK, T_BYE = (int(t) for t in FrameType)


class WireStatus(IntEnum):
    OK = 0
    BAD_KEY = 1
    OUT_OF_BOUNDS = 2


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    flags: FrameFlag = FrameFlag.NONE
    key: int = 0
    imm: int = 0
    offset: int = 0
    length: int = 0
    seq: int = 0
    status: WireStatus = WireStatus.OK

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.type, self.flags, self.status, self.key, self.imm,
                           self.offset, self.length, self.seq)


def unpack_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Parse one header; ``TransferError`` for a bad magic, version, type or status."""
    magic, version, ftype, flags, status, key, imm, offset, length, seq = HEADER.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"bad frame header (magic {magic:#x}, version {version})")
    try:
        return Frame(FrameType(ftype), FrameFlag(flags), key, imm, offset, length, seq, WireStatus(status))
    except ValueError as exc:
        raise TransferError(f"bad frame header: {exc}") from exc


def recv_exact(sock: socket.socket, buf: memoryview) -> bool:
    """Fill ``buf`` from ``sock`` (blocking, ``MSG_WAITALL``, no intermediate copy).

    Returns False on a clean EOF before the first byte; raises ``PeerLostError`` on EOF after
    a partial read and ``OSError`` on socket errors.
    """
    got, want = 0, len(buf)
    while got < want:
        n = sock.recv_into(buf[got:], want - got, socket.MSG_WAITALL)
        if n == 0:
            if got == 0:
                return False
            raise PeerLostError(f"connection closed after {got} of {want} bytes")
        got += n
    return True


def recv_exact_many(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Fill every buffer of ``bufs`` in order (scatter ``recvmsg_into``, ``MSG_WAITALL``).

    Only for data the peer is known to send: raises ``PeerLostError`` on EOF."""
    bufs = [b for b in bufs if len(b)]
    i = 0
    while i < len(bufs):
        n = sock.recvmsg_into(bufs[i:i + IOV_BATCH], 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise PeerLostError("connection closed inside a frame")
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]


def discard(sock: socket.socket, length: int, scratch: memoryview) -> None:
    """Read and drop ``length`` bytes (a rejected write's payload) to keep the stream in sync."""
    while length > 0:
        chunk = scratch[:min(length, len(scratch))]
        if not recv_exact(sock, chunk):
            raise PeerLostError("connection closed inside a rejected payload")
        length -= len(chunk)


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send every byte of ``parts`` (bytes / memoryviews) with as few syscalls as possible."""
    for i in range(0, len(parts), IOV_BATCH):
        _send_iov(sock, parts[i:i + IOV_BATCH])


def _send_iov(sock: socket.socket, parts: list) -> None:
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    if sent == total:
        return
    for part in parts:
        mv = memoryview(part).cast("B")
        if sent >= len(mv):
            sent -= len(mv)
            continue
        sock.sendall(mv[sent:])
        sent = 0
