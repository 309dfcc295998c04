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
    NOTIFY (writer -> receiver, shm): ``length`` = N write descriptors follow, no payloads: the
           writer already copied each descriptor's bytes into the shared mapping; the receiver
           checks them and delivers each ``imm`` iff its descriptor has HAS_IMM.
    ACK    (receiver -> writer): completes the batch part with sequence number ``seq``;
           ``status`` is the first :class:`WireStatus` error among its writes (OK if none),
           ``length`` the number of its writes rejected.
    BYE    (writer -> receiver): graceful end of the stream; nothing may follow.

Batches and groups. A stream numbers its batch parts 1, 2, 3, ... in send order. The writer's tx
thread takes every part already queued (a group) and sends their descriptors back to back, packed
into as few WRITE/NOTIFY frames as :data:`MAX_DESCS` allows; the last descriptor of each part
carries END_BATCH. A frame in which at least one part ends has ACK_REQ and ``seq`` = the first
part ending in it (the next ones are ``seq + 1``, ...). The receiver queues one ACK per ended part
and sends its queued ACKs when a frame has FLUSH, which the writer sets on the last frame of a
group. One post list per group, as verbs does with a chain of work requests: the per-frame and per
round-trip costs are paid once per group rather than once per posted batch, which is what small
per-layer KV batches need when the writer posts faster than the wire drains.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from enum import IntEnum, IntFlag

import numpy as np

from kvtransfer.base import write_arrays
from kvtransfer.errors import PeerLostError, TransferError

if TYPE_CHECKING:
    from kvtransfer.base import WriteOp
    from kvtransfer.memory import MemoryTable, Registration

MAGIC = 0x4B56
VERSION = 2   # 2: groups (END_BATCH, FLUSH)
HEADER = struct.Struct("!HBBHHIIQQQ")
HEADER_SIZE = HEADER.size
DESC = struct.Struct("!IIQQI")
DESC_SIZE = DESC.size
# The same record as a numpy dtype (packed, big-endian) for vectorised checks at the receiver.
DESC_DTYPE = np.dtype([("key", ">u4"), ("imm", ">u4"), ("offset", ">u8"), ("length", ">u8"), ("flags", ">u4")])
assert DESC_DTYPE.itemsize == DESC_SIZE
MAX_DESCS = 1024
IOV_BATCH = 1000  # at most IOV_MAX (1024) buffers per sendmsg / recvmsg


class FrameType(IntEnum):
    WRITE = 1
    NOTIFY = 2
    ACK = 3
    BYE = 4


class FrameFlag(IntFlag):
    """Header flags (HAS_IMM is kept for the header's own ``imm`` field, unused by the engines)."""

    NONE = 0
    HAS_IMM = 1
    ACK_REQ = 2
    FLUSH = 4


# Plain-int copies for hot loops (IntFlag arithmetic costs microseconds per call).
F_ACK_REQ, F_FLUSH = int(FrameFlag.ACK_REQ), int(FrameFlag.FLUSH)
# Descriptor flags (the ``flags`` field of :data:`DESC`).
D_HAS_IMM, D_END_BATCH = 1, 2
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


def pack_descs(ops: "Sequence[WriteOp]") -> bytes:
    """The :data:`DESC` records of one batch part (remote key, immediate, remote offset, length),
    back to back, its last one flagged END_BATCH. A `WriteOps` is packed from its arrays."""
    if (arrays := write_arrays(ops)) is not None:
        descs = np.empty(len(ops), DESC_DTYPE)
        descs["key"], descs["imm"] = ops.remote_key, ops.imm or 0
        descs["offset"], descs["length"] = arrays[1], arrays[2]
        descs["flags"] = D_HAS_IMM if ops.imm is not None else 0
        descs["flags"][-1] |= D_END_BATCH
        return descs.tobytes()
    pack = DESC.pack
    out = [pack(op.remote_key, op.imm or 0, op.remote_offset, op.length,
                D_HAS_IMM if op.imm is not None else 0) for op in ops]
    if ops:
        last = ops[-1]
        out[-1] = pack(last.remote_key, last.imm or 0, last.remote_offset, last.length,
                       (D_HAS_IMM if last.imm is not None else 0) | D_END_BATCH)
    return b"".join(out)


def group_frames(ftype: int, batches: "Sequence[tuple[Sequence[WriteOp], int]]",
                 with_ops: bool = True) -> "list[tuple[bytes, list[WriteOp]]]":
    """Frames (header + descriptors, and the ops whose descriptors they carry) sending the
    batch parts ``[(ops, seq), ...]`` (non-empty, consecutive ``seq``) as one group; see the
    module docstring. ``with_ops`` False: each frame's op list is empty (a NOTIFY carries no
    payload, so shm and cuda_ipc need none: a `WriteOps` then builds no op). Raises
    ``ValueError`` for an empty or non-consecutive group."""
    if not batches or any(not len(ops) for ops, _ in batches):
        raise ValueError("a group needs at least one part and no empty part")
    if any(b[1] != batches[0][1] + i for i, b in enumerate(batches)):
        raise ValueError("the parts of a group must have consecutive sequence numbers")
    flat: list[WriteOp] = [op for ops, _ in batches for op in ops] if with_ops else []
    ends: list[int] = []   # index of each part's last op in the group
    for ops, _ in batches:
        ends.append((ends[-1] if ends else -1) + len(ops))
    raw = b"".join(pack_descs(ops) for ops, _ in batches)
    frames, part, total = [], 0, ends[-1] + 1
    for start in range(0, total, MAX_DESCS):
        stop = min(start + MAX_DESCS, total)
        flags, seq = 0, 0
        if part < len(ends) and ends[part] < stop:
            flags, seq = F_ACK_REQ, batches[part][1]
            while part < len(ends) and ends[part] < stop:
                part += 1
        if stop == total:
            flags |= F_FLUSH
        header = HEADER.pack(MAGIC, VERSION, ftype, flags, 0, 0, 0, 0, stop - start, seq)
        frames.append((header + raw[start * DESC_SIZE:stop * DESC_SIZE], flat[start:stop]))
    return frames


@dataclass(slots=True)
class CheckedDescs:
    """Descriptors of one frame after the receiver's key and bounds checks.

    ``status`` is a ``uint8`` array of :class:`WireStatus` per descriptor (all zero when
    ``rejected`` is 0); ``regs`` maps each valid key to its registration; ``imms`` are the
    immediates (``uint32``, wire order kept) of the accepted descriptors that carry one;
    ``nbytes`` the bytes of the accepted descriptors.
    """

    descs: np.ndarray
    status: np.ndarray
    regs: "dict[int, Registration]"
    imms: np.ndarray
    rejected: int
    first_error: int
    nbytes: int


def check_descs(raw: "bytes | bytearray | memoryview", memory: "MemoryTable",
                need_shared: bool = False) -> CheckedDescs:
    """Parse ``raw`` (N x :data:`DESC`) and check every descriptor against ``memory``.

    A descriptor is BAD_KEY when its key is not registered (or, with ``need_shared``, its region
    is not shared memory) and OUT_OF_BOUNDS when ``length`` is 0 or ``[offset, offset + length)``
    leaves the region (a sum that wraps around 2**64 counts as outside). Both are reported to the
    writer and their payload is consumed and dropped. A write *longer than its region* (for an
    unknown key: longer than every registered region) cannot come from a correct writer, and
    consuming its payload could mean reading gigabytes or forever: `TransferError` is raised and
    the caller drops the connection. Vectorised: the cost per frame is a few numpy calls plus one
    table lookup per distinct key, not Python work per write.
    """
    descs = np.frombuffer(raw, dtype=DESC_DTYPE)
    keys, offsets, lengths = descs["key"], descs["offset"], descs["length"]
    if len(lengths) and int(lengths.max()) > memory.max_length():
        raise TransferError(f"protocol error: a write of {int(lengths.max())} bytes is longer than "
                            "any registered region")
    status = np.zeros(len(descs), dtype=np.uint8)
    regs: dict[int, Registration] = {}
    first = int(keys[0]) if len(keys) else 0
    single = bool((keys == first).all())
    for key in ([first] if single else np.unique(keys).tolist()):
        rows = slice(None) if single else keys == key
        reg = memory.get(key)
        if reg is None or (need_shared and reg.shared is None):
            status[rows] = _BAD_KEY
            continue
        regs[key] = reg
        off, ln = offsets[rows], lengths[rows]
        if int(ln.max()) > reg.region.length:
            raise TransferError(f"protocol error: a write of {int(ln.max())} bytes into a region of "
                                f"{reg.region.length}")
        end = off + ln   # uint64; wraps for a hostile offset, caught by end < off
        outside = (ln == 0) | (end > np.uint64(reg.region.length)) | (end < off)
        status[rows] = outside.view(np.uint8) * np.uint8(_OUT_OF_BOUNDS)
    has_imm = (descs["flags"] & D_HAS_IMM) != 0
    bad = np.flatnonzero(status)
    if len(bad) == 0:
        return CheckedDescs(descs, status, regs, descs["imm"][has_imm], 0, 0, int(lengths.sum()))
    ok = status == 0
    return CheckedDescs(descs, status, regs, descs["imm"][has_imm & ok], len(bad), int(status[bad[0]]),
                        int(lengths[ok].sum()))


_BAD_KEY, _OUT_OF_BOUNDS = int(WireStatus.BAD_KEY), int(WireStatus.OUT_OF_BOUNDS)


def imm_runs(imms: np.ndarray) -> list[tuple[int, int]]:
    """``(immediate, count)`` for each run of equal consecutive values of ``imms``."""
    if len(imms) == 0:
        return []
    starts = np.flatnonzero(imms[1:] != imms[:-1]) + 1
    bounds = [0, *starts.tolist(), len(imms)]
    values = imms[bounds[:-1]].tolist()
    return [(v, bounds[i + 1] - bounds[i]) for i, v in enumerate(values)]
