"""``pdserve doctor``: what an operator needs to know about a host's data plane before blaming
the code - which pyverbs and from where, each RDMA device's ports (state, link layer, active MTU,
the GID table with types and the index the engine would choose), the memlock limit that memory
registration counts against, the GPU and which GPUDirect path (dma-buf, nvidia-peermem) exists,
and which engine ``--transfer-engine auto`` picks and why (found by doing what auto does).
"""

from __future__ import annotations

import ipaddress
import resource
from dataclasses import asdict, dataclass, field

from kvtransfer.config import EngineConfig, VerbsConfig
from kvtransfer.errors import EngineUnavailableError


@dataclass(frozen=True, slots=True)
class GidRow:
    index: int
    gid: str
    gid_type: str
    netdev: str
    chosen: bool


@dataclass(frozen=True, slots=True)
class PortRow:
    device: str
    port: int
    state: str
    link_layer: str
    active_mtu: int
    max_mtu: int
    lid: int
    gids: list[GidRow]
    gid_index: int | None
    gid_reason: str
    problem: str


@dataclass(frozen=True, slots=True)
class GpuRow:
    index: int
    name: str
    dmabuf: bool


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """Everything :func:`diagnose` found; ``to_dict`` for JSON, ``format`` for people."""

    pyverbs_version: str
    pyverbs_origin: str
    pyverbs_error: str
    devices_error: str
    ports: list[PortRow]
    memlock_soft: int   # bytes; -1 = unlimited
    memlock_hard: int
    cuda_available: bool
    gpus: list[GpuRow]
    nvidia_peermem: bool
    auto_engine: str
    auto_reason: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [f"pyverbs: {self.pyverbs_version} ({self.pyverbs_origin})" if not self.pyverbs_error
                 else f"pyverbs: not usable: {self.pyverbs_error}"]
        if self.devices_error:
            lines.append(f"RDMA devices: none ({self.devices_error})")
        for p in self.ports:
            lines.append(f"{p.device} port {p.port}: {p.state}, {p.link_layer}, active MTU {p.active_mtu} "
                         f"(max {p.max_mtu}), LID {p.lid}")
            for g in p.gids:
                mark = "  <- chosen" if g.chosen else ""
                lines.append(f"    GID[{g.index}] {g.gid} {g.gid_type} {g.netdev}{mark}")
            lines.append(f"    GID index: {p.gid_index} ({p.gid_reason})" if p.problem == ""
                         else f"    unusable: {p.problem}")
        lines.append(f"memlock: soft {_limit(self.memlock_soft)}, hard {_limit(self.memlock_hard)}")
        if self.cuda_available:
            for g in self.gpus:
                lines.append(f"GPU {g.index}: {g.name}, dma-buf export {'yes' if g.dmabuf else 'no'}")
        else:
            lines.append("GPU: no CUDA device")
        lines.append(f"nvidia-peermem: {'loaded' if self.nvidia_peermem else 'not loaded'}")
        lines.append(f"auto would use: {self.auto_engine} ({self.auto_reason})")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _limit(value: int) -> str:
    return "unlimited" if value < 0 else f"{value // 1024} KiB"


def _ports() -> tuple[list[PortRow], str]:
    from kvtransfer.verbs.device import query_port
    from kvtransfer.verbs.support import bytes_to_gid, list_rdma_devices

    try:
        names = list_rdma_devices()
    except EngineUnavailableError as exc:
        return [], str(exc)
    from pyverbs.device import Context

    rows = []
    for name in names:
        with Context(name=name) as ctx:
            for port in range(1, int(ctx.query_device().phys_port_cnt) + 1):
                info = query_port(ctx, name, VerbsConfig(device=name, port=port))
                gids = [GidRow(g.index, str(ipaddress.IPv6Address(g.gid)) if g.ipv4 else bytes_to_gid(g.gid),
                               g.gid_type, g.netdev, g.index == info.gid_index) for g in info.gids]
                rows.append(PortRow(name, port, info.state_name, info.link_layer_name, info.active_mtu,
                                    info.max_mtu, info.lid, gids, info.gid_index, info.gid_reason, info.problem))
    return rows, ""


def _gpus() -> tuple[bool, list[GpuRow]]:
    import torch

    if not torch.cuda.is_available():
        return False, []
    from kvtransfer.verbs.gpu import dmabuf_supported
    return True, [GpuRow(i, torch.cuda.get_device_name(i), dmabuf_supported(i))
                  for i in range(torch.cuda.device_count())]


def diagnose(config: EngineConfig) -> DoctorReport:
    """Look at this host (see the module docstring). Never raises for what it finds missing."""
    from kvtransfer.auto import choose_primary
    from kvtransfer.connection import Shared
    from kvtransfer.verbs.compat import version
    from kvtransfer.verbs.gpu import peermem_loaded

    try:
        pv = version()
        pv_version, pv_origin, pv_error = pv.version, pv.origin, ""
    except EngineUnavailableError as exc:
        pv_version, pv_origin, pv_error = "", "", str(exc)
    ports, devices_error = _ports() if not pv_error else ([], pv_error)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cuda, gpus = _gpus()
    engine, choice = choose_primary(config, Shared.create(config, None))
    engine.close()
    notes = []
    if soft != resource.RLIM_INFINITY and soft < 64 << 20 and ports:
        notes.append("memlock is low: registering a KV pool pins it (ulimit -l unlimited; docker: "
                     "--ulimit memlock=-1 --cap-add IPC_LOCK)")
    if cuda and not peermem_loaded() and not any(g.dmabuf for g in gpus):
        notes.append("no GPUDirect path: neither dma-buf export nor nvidia-peermem")
    return DoctorReport(pv_version, pv_origin, pv_error, devices_error, ports,
                        -1 if soft == resource.RLIM_INFINITY else soft,
                        -1 if hard == resource.RLIM_INFINITY else hard,
                        cuda, gpus, peermem_loaded(), choice.name, choice.reason, notes)
