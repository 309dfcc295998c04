"""Device-free parts of the verbs engine: device listing, the QP connection record exchanged at
bootstrap, the attributes of each QP state transition, GID choice, work-request ids and fields,
and the send budget. Everything here is unit-tested without an RDMA device;
:mod:`kvtransfer.verbs.engine` and :mod:`kvtransfer.verbs.device` feed these values into pyverbs.

Sources: ``infiniband/verbs.h`` (ABI constants, stable across rdma-core releases), the IB
Architecture Specification vol. 1 (QP state machine 10.3, RNR NAK timer table 45, local ACK
timeout 9.7.6.1.3), the RoCE v2 annex A17 (GID types, IPv4-mapped GIDs), rdma-core's
``tests/base.py`` (RC set-up: the RTR/RTS attribute masks).
"""

from __future__ import annotations

import ipaddress
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from kvtransfer.errors import EngineUnavailableError, NoRdmaDeviceError, TransferError
from kvtransfer.immediate import to_network_u32
from kvtransfer.verbs.compat import import_pyverbs

# ibv enum values (verbs.h ABI, stable): used so pure helpers need no pyverbs import.
IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR = 0, 1, 2, 3, 6
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE = 1, 2
IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM = 0, 1
IBV_SEND_SIGNALED = 2
IBV_WC_SUCCESS, IBV_WC_REM_ACCESS_ERR, IBV_WC_WR_FLUSH_ERR = 0, 10, 5
IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR = 12, 13
IBV_WC_RECV_RDMA_WITH_IMM = 129  # 1 << 7 | 1
IBV_PORT_ACTIVE = 4
IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 1, 2
# ibv_qp_attr_mask bits
QP_STATE, QP_ACCESS_FLAGS, QP_PKEY_INDEX, QP_PORT = 1 << 0, 1 << 3, 1 << 4, 1 << 5
QP_AV, QP_PATH_MTU, QP_TIMEOUT, QP_RETRY_CNT, QP_RNR_RETRY = 1 << 7, 1 << 8, 1 << 9, 1 << 10, 1 << 11
QP_RQ_PSN, QP_MAX_QP_RD_ATOMIC, QP_MIN_RNR_TIMER, QP_SQ_PSN = 1 << 12, 1 << 13, 1 << 15, 1 << 16
QP_MAX_DEST_RD_ATOMIC, QP_DEST_QPN = 1 << 17, 1 << 20
INIT_MASK = QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
RTR_MASK = QP_STATE | QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN | QP_MAX_DEST_RD_ATOMIC | QP_MIN_RNR_TIMER
RTS_MASK = QP_STATE | QP_SQ_PSN | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MTU_BYTES = {v: k for k, v in MTU_ENUM.items()}
# IB spec vol. 1, table 45: RNR NAK timer field -> milliseconds (0 encodes the longest, 655.36).
RNR_TIMER_MS = (655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96,
                1.28, 1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92,
                122.88, 163.84, 245.76, 327.68, 491.52)
WC_STATUS_NAMES = {0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
                   5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR",
                   9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR",
                   13: "RNR_RETRY_EXC_ERR", 14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR",
                   16: "REM_ABORT_ERR", 17: "INV_EECN_ERR", 18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR",
                   20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR"}
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}


def list_rdma_devices() -> list[str]:
    """Names of the RDMA devices. Raises ``EngineUnavailableError`` (no pyverbs) or
    ``NoRdmaDeviceError`` (``get_device_list`` fails, e.g. ENOSYS without kernel support, or is
    empty)."""
    import_pyverbs()
    from pyverbs.device import get_device_list
    from pyverbs.pyverbs_error import PyverbsError

    try:
        devices = get_device_list()
    except PyverbsError as exc:
        raise NoRdmaDeviceError(f"no RDMA device: the kernel reports none ({exc})") from exc
    if not devices:
        raise NoRdmaDeviceError("no RDMA device: ibv_get_device_list returned no devices")
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def rdma_device_available() -> bool:
    """True iff pyverbs imports and at least one RDMA device is present."""
    try:
        list_rdma_devices()
    except EngineUnavailableError:
        return False
    return True


# -- GIDs -------------------------------------------------------------------------------------
def gid_to_bytes(gid: str) -> bytes:
    """16 raw bytes of a GID written as pyverbs prints it (8 groups of 4 hex digits)."""
    return ipaddress.IPv6Address(gid).packed


def bytes_to_gid(raw: bytes) -> str:
    """The GID string pyverbs' ``GID(...)`` accepts: ``xxxx:xxxx:...`` (exactly 8 groups of 4)."""
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


@dataclass(frozen=True, slots=True)
class GidEntry:
    """One row of a port's GID table: ``index``, the 16 ``gid`` bytes, ``gid_type`` as the
    kernel names it (``"RoCE v2"``, ``"IB/RoCE v1"``), ``netdev`` (RoCE: the Ethernet device)."""

    index: int
    gid: bytes
    gid_type: str
    netdev: str = ""

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
        mapped = ipaddress.IPv6Address(self.gid).ipv4_mapped
        return str(mapped) if mapped is not None else None

    @property
    def link_local(self) -> bool:
        return ipaddress.IPv6Address(self.gid).is_link_local


def choose_gid(entries: Sequence[GidEntry], link_layer: int) -> tuple[int, str]:
    """The GID index to use and why, as Mooncake's ``findBestGidIndex`` and NCCL do it:

    InfiniBand: index 0 (LID routing; the GID is only used across subnets). RoCE: a RoCE v2
    GID (UDP/IP, routable; v1 is raw Ethernet, one L2 domain) with an IPv4-mapped address first,
    then a global IPv6 one, then a link-local one; RoCE v1 only if no v2 entry exists. Zero GIDs
    (empty slots) never. Raises ``NoRdmaDeviceError`` when the table has no usable entry.
    """
    if link_layer == IBV_LINK_LAYER_INFINIBAND:
        return 0, "InfiniBand: LID routing, GID index 0"
    live = [e for e in entries if e.gid != bytes(16)]

    def rank(e: GidEntry) -> tuple[int, int, int]:
        v2 = "v2" in e.gid_type.lower()
        return (0 if v2 else 1, 0 if e.ipv4 else 1 if not e.link_local else 2, e.index)

    if not live:
        raise NoRdmaDeviceError("the port's GID table is empty (no IP address on its netdev?)")
    best = min(live, key=rank)
    address = best.ipv4 or str(ipaddress.IPv6Address(best.gid))
    kind = "IPv4-mapped" if best.ipv4 else "link-local IPv6" if best.link_local else "IPv6"
    return best.index, f"{best.gid_type} {kind} {address}" + (f" on {best.netdev}" if best.netdev else "")


# -- connection record ------------------------------------------------------------------------
_QP_INFO = struct.Struct("!HII16sIIB")
_QP_INFO_VERSION = 2


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What each side of an RC connection tells the other at bootstrap.

    ``gid`` is the 16 raw GID bytes (RoCE / global routing; zero for IB LID routing), ``lid`` the
    port LID (0 on RoCE), ``psn`` the 24-bit initial packet sequence number, ``mtu`` in bytes:
    the sender's usable path MTU (its configured MTU clamped to its port's ``active_mtu``).
    """

    qp_num: int
    psn: int
    gid: bytes
    lid: int
    mtu: int
    version: int = _QP_INFO_VERSION

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError(f"gid must be 16 bytes, got {len(self.gid)}")
        if not 0 <= self.psn < 1 << 24 or not 0 <= self.qp_num < 1 << 24:
            raise ValueError("psn and qp_num are 24-bit values")
        if self.mtu not in MTU_ENUM:
            raise ValueError(f"mtu must be one of {sorted(MTU_ENUM)}")

    def to_bytes(self) -> bytes:
        return _QP_INFO.pack(self.version, self.qp_num, self.psn, self.gid, self.lid, self.mtu, 0)

    @classmethod
    def from_bytes(cls, data: bytes) -> "QpInfo":
        if len(data) != _QP_INFO.size:
            raise TransferError(f"QpInfo is {_QP_INFO.size} bytes, got {len(data)}")
        version, qp_num, psn, gid, lid, mtu, _ = _QP_INFO.unpack(data)
        if version != _QP_INFO_VERSION:
            raise TransferError(f"QpInfo version {version}, expected {_QP_INFO_VERSION}")
        try:
            return cls(qp_num, psn, gid, lid, mtu, version)
        except ValueError as exc:
            raise TransferError(f"malformed QpInfo: {exc}") from exc


QP_INFO_SIZE = _QP_INFO.size


def path_mtu(local_mtu: int, active_mtu: int, remote_mtu: int) -> int:
    """The path MTU in bytes: the smallest of ours (configured), our port's active MTU and the
    peer's. rxe over a 1500-byte Ethernet device reports ``active_mtu`` 1024."""
    return min(local_mtu, active_mtu, remote_mtu)


def init_attrs(port: int) -> dict[str, int]:
    """RESET -> INIT: port, pkey 0, remote write allowed (what a receiver needs)."""
    return {"qp_state": IBV_QPS_INIT, "pkey_index": 0, "port_num": port,
            "qp_access_flags": IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE}


def rtr_attrs(remote: QpInfo, mtu: int, port: int, gid_index: int, min_rnr_timer: int) -> dict[str, object]:
    """INIT -> RTR: path to the remote QP. ``mtu`` is the path MTU in bytes (:func:`path_mtu`).

    Global routing (a GRH) whenever the remote GID is non-zero - RoCE always needs it - with
    ``dgid`` as the GID string pyverbs' ``GID`` takes and our ``sgid_index``; LID routing
    otherwise (InfiniBand in one subnet).
    """
    use_grh = remote.gid != bytes(16)
    ah: dict[str, object] = {"dlid": remote.lid, "sl": 0, "src_path_bits": 0, "port_num": port,
                             "is_global": int(use_grh)}
    if use_grh:
        ah["grh"] = {"dgid": bytes_to_gid(remote.gid), "sgid_index": gid_index, "hop_limit": 64,
                     "flow_label": 0, "traffic_class": 0}
    return {"qp_state": IBV_QPS_RTR, "path_mtu": MTU_ENUM[mtu], "dest_qp_num": remote.qp_num,
            "rq_psn": remote.psn, "max_dest_rd_atomic": 1, "min_rnr_timer": min_rnr_timer, "ah_attr": ah}


def rts_attrs(local_psn: int, timeout: int, retry_count: int, rnr_retry: int) -> dict[str, int]:
    """RTR -> RTS: our send PSN and retry policy."""
    return {"qp_state": IBV_QPS_RTS, "sq_psn": local_psn, "timeout": timeout, "retry_cnt": retry_count,
            "rnr_retry": rnr_retry, "max_rd_atomic": 1}


# -- work requests ----------------------------------------------------------------------------
class WrKind(IntEnum):
    """What a completion belongs to, from its ``wr_id`` alone (a WC's opcode is undefined when
    its status is not success, ``ibv_poll_cq(3)``)."""

    WRITE = 0
    RECV = 2
    DRAIN = 3


_KIND_SHIFT = 62
_ID_MASK = (1 << _KIND_SHIFT) - 1


def make_wr_id(kind: WrKind, number: int) -> int:
    return (int(kind) << _KIND_SHIFT) | (number & _ID_MASK)


def split_wr_id(wr_id: int) -> tuple[WrKind, int]:
    return WrKind(wr_id >> _KIND_SHIFT), wr_id & _ID_MASK


@dataclass(frozen=True, slots=True)
class WriteWithImm:
    """Fields of one ``IBV_WR_RDMA_WRITE(_WITH_IMM)`` send WR (one SGE).

    ``imm_data`` is already in network byte order (``ibv_send_wr.imm_data`` is ``__be32``).
    """

    wr_id: int
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int
    imm_data: int
    opcode: int = IBV_WR_RDMA_WRITE_WITH_IMM
    send_flags: int = IBV_SEND_SIGNALED


def write_with_imm(wr_id: int, local_addr: int, length: int, lkey: int, remote_addr: int, rkey: int,
                   imm: int | None, signaled: bool = True) -> WriteWithImm:
    """Build the WR fields; ``imm`` is the host-order immediate (converted here), or None for a
    plain RDMA WRITE. ``ValueError`` for a length outside (0, 2**31] (``ibv_sge.length``)."""
    if length <= 0 or length > 1 << 31:
        raise ValueError(f"RDMA write length must be in (0, 2**31], got {length}")
    return WriteWithImm(wr_id, local_addr, length, lkey, remote_addr, rkey,
                        0 if imm is None else to_network_u32(imm),
                        IBV_WR_RDMA_WRITE if imm is None else IBV_WR_RDMA_WRITE_WITH_IMM,
                        IBV_SEND_SIGNALED if signaled else 0)


class Credits:
    """A bounded count of free slots (completion-queue entries, send-queue WQEs). ``take`` never
    blocks: it takes what is there, up to ``n``; ``give`` returns slots. Thread-safe."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"credits must be positive, got {total}")
        self.total = total
        self._free = total
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return self._free

    def take(self, n: int) -> int:
        with self._lock:
            got = min(n, self._free)
            self._free -= got
            return got

    def give(self, n: int) -> None:
        with self._lock:
            if self._free + n > self.total:
                raise AssertionError(f"credits over-returned: {self._free} + {n} > {self.total}")
            self._free += n


# -- bootstrap messages -----------------------------------------------------------------------
# After the shared-secret handshake (kvtransfer.auth) on the bootstrap TCP connection:
#   W -> R  HELLO (magic, version, n) + n QpInfo      the writer's new QPs
#   R -> W  HELLO (magic, version, n) + n QpInfo      sent once the receiver's QPs are at RTR,
#                                                     so the writer cannot write too early
#   W -> R  READY                                     the writer's QPs are at RTS
# then, on the same connection until it closes (EOF without BYE = the peer is lost):
#   W -> R  RECONNECT n + n QpInfo   replace the QPs (the old ones went to ERR)
#   R -> W  RECONNECTED n + n QpInfo
#   W -> R  BYE                      graceful disconnect: every posted write has completed
HELLO = struct.Struct("!4sHH")
HELLO_MAGIC = b"PDVB"
BOOTSTRAP_VERSION = 1
MSG_READY, MSG_RECONNECT, MSG_RECONNECTED, MSG_BYE = b"R", b"C", b"c", b"B"
COUNT = struct.Struct("!H")
MAX_QPS_PER_PEER = 16


def pack_hello(infos: Sequence[QpInfo]) -> bytes:
    return HELLO.pack(HELLO_MAGIC, BOOTSTRAP_VERSION, len(infos)) + b"".join(i.to_bytes() for i in infos)


def unpack_hello(header: bytes) -> int:
    """Number of QpInfo records that follow a HELLO header; ``TransferError`` if it is not one."""
    magic, version, count = HELLO.unpack(header)
    if magic != HELLO_MAGIC or version != BOOTSTRAP_VERSION:
        raise TransferError(f"verbs bootstrap: got magic {magic!r} version {version}, expected "
                            f"{HELLO_MAGIC!r} version {BOOTSTRAP_VERSION}")
    if not 1 <= count <= MAX_QPS_PER_PEER:
        raise TransferError(f"verbs bootstrap: {count} QPs (1..{MAX_QPS_PER_PEER} allowed)")
    return count


def pack_qp_list(kind: bytes, infos: Sequence[QpInfo]) -> bytes:
    return kind + COUNT.pack(len(infos)) + b"".join(i.to_bytes() for i in infos)
