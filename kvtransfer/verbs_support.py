"""Device-free parts of the verbs engine: pyverbs import and device detection, the QP connection
record exchanged at bootstrap, the attributes of each QP state transition, and send/receive work
request fields. Everything here is unit-tested without an RDMA device; :mod:`kvtransfer.verbs`
feeds these values into pyverbs objects.
"""

from __future__ import annotations

import importlib
import struct
import sys
from dataclasses import dataclass
from types import ModuleType

from kvtransfer.errors import EngineUnavailableError, NoRdmaDeviceError, TransferError
from kvtransfer.immediate import to_network_u32

PYVERBS_MISSING = ("pyverbs is not installed: install your distribution's rdma-core python bindings "
                   "(Debian/Ubuntu: apt-get install python3-pyverbs)")
# Debian's python3-pyverbs installs here for the system python; a venv of the same minor version
# can import it from there.
SYSTEM_DIST_PACKAGES = "/usr/lib/python3/dist-packages"

# ibv enum values (verbs.h ABI, stable): used so pure helpers need no pyverbs import.
IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS = 1, 2, 3
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE = 1, 2
IBV_WR_RDMA_WRITE_WITH_IMM = 1
IBV_SEND_SIGNALED = 2
IBV_WC_RECV_RDMA_WITH_IMM = 129  # 1 << 7 | 1
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}


def import_pyverbs() -> ModuleType:
    """Import pyverbs, falling back to the system dist-packages (Debian ``python3-pyverbs``).

    Raises ``EngineUnavailableError`` with :data:`PYVERBS_MISSING` when neither works.
    """
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    if SYSTEM_DIST_PACKAGES not in sys.path:
        sys.path.append(SYSTEM_DIST_PACKAGES)
        try:
            module = importlib.import_module("pyverbs")
            for sub in ("device", "pd", "mr", "cq", "qp", "srq", "wr", "addr", "enums", "pyverbs_error"):
                importlib.import_module(f"pyverbs.{sub}")
            return module
        except ImportError:
            pass
        finally:
            sys.path.remove(SYSTEM_DIST_PACKAGES)
    raise EngineUnavailableError(PYVERBS_MISSING)


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


_QP_INFO = struct.Struct("!HII16sIIB")
_QP_INFO_VERSION = 1


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What each side of an RC connection tells the other at bootstrap.

    ``gid`` is the 16 raw GID bytes (RoCE / global routing; zero for IB LID routing), ``lid`` the
    port LID (0 on RoCE), ``psn`` the 24-bit initial packet sequence number, ``mtu`` in bytes.
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
        return cls(qp_num, psn, gid, lid, mtu, version)


QP_INFO_SIZE = _QP_INFO.size


def init_attrs(port: int) -> dict[str, int]:
    """RESET -> INIT: port, pkey 0, remote write allowed (what a receiver needs)."""
    return {"qp_state": IBV_QPS_INIT, "pkey_index": 0, "port_num": port,
            "qp_access_flags": IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE}


def rtr_attrs(remote: QpInfo, local_mtu: int, port: int, gid_index: int) -> dict[str, object]:
    """INIT -> RTR: path to the remote QP. Uses global routing (GRH) whenever the remote GID is
    non-zero (RoCE requires it), LID routing otherwise. MTU = min of both sides."""
    use_grh = remote.gid != bytes(16)
    ah = {"dlid": remote.lid, "sl": 0, "src_path_bits": 0, "port_num": port, "is_global": int(use_grh)}
    if use_grh:
        ah.update({"dgid": remote.gid, "sgid_index": gid_index, "hop_limit": 64, "flow_label": 0,
                   "traffic_class": 0})
    return {"qp_state": IBV_QPS_RTR, "path_mtu": MTU_ENUM[min(remote.mtu, local_mtu)],
            "dest_qp_num": remote.qp_num, "rq_psn": remote.psn, "max_dest_rd_atomic": 1,
            "min_rnr_timer": 12, "ah_attr": ah}


def rts_attrs(local_psn: int, timeout: int, retry_count: int, rnr_retry: int) -> dict[str, int]:
    """RTR -> RTS: our send PSN and retry policy."""
    return {"qp_state": IBV_QPS_RTS, "sq_psn": local_psn, "timeout": timeout, "retry_cnt": retry_count,
            "rnr_retry": rnr_retry, "max_rd_atomic": 1}


@dataclass(frozen=True, slots=True)
class WriteWithImm:
    """Fields of one ``IBV_WR_RDMA_WRITE_WITH_IMM`` send WR (one SGE).

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
                   imm: int, signaled: bool = True) -> WriteWithImm:
    """Build the WR fields; ``imm`` is the host-order immediate (converted here)."""
    if length <= 0 or length > 1 << 31:
        raise ValueError(f"RDMA write length must be in (0, 2**31], got {length}")
    return WriteWithImm(wr_id, local_addr, length, lkey, remote_addr, rkey, to_network_u32(imm),
                        send_flags=IBV_SEND_SIGNALED if signaled else 0)
