"""One RDMA device as the verbs engine uses it: context, protection domain, a completion channel
and one CQ, a shared receive queue kept stocked, and the port (state, link layer, active MTU,
the GID table and the index chosen from it).

Resources and who owns them: :class:`Device` creates everything in its constructor (partially
built resources are released when a step fails) and destroys it in :meth:`Device.close`, after
the engine has destroyed its QPs and memory regions. It does no waiting of its own: the engine's
CQ thread selects on :attr:`Device.cq_fd` / :attr:`Device.async_fd` and calls :meth:`poll`,
:meth:`arm`, :meth:`read_async_event` and :meth:`refill`.

Receive WQEs: each incoming WRITE WITH IMMEDIATE consumes one (IB spec vol. 1, 9.4.3.1), so the
SRQ holds ``srq_depth`` of them, each with one SGE on a small registered scratch buffer (pyverbs
before v57 refuses receive WRs without an SGE; the buffer is never written, a write's payload
goes to the address it names). Consumed WQEs are re-posted in batches by :meth:`refill`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from kvtransfer.config import VerbsConfig
from kvtransfer.errors import EngineUnavailableError, NoRdmaDeviceError, TransferError
from kvtransfer.verbs.compat import comp_channel_fd, enum, import_pyverbs, new_event_fds
from kvtransfer.verbs.support import (IBV_ACCESS_LOCAL_WRITE, IBV_LINK_LAYER_ETHERNET, IBV_PORT_ACTIVE,
                                      LINK_LAYERS, MTU_BYTES, PORT_STATES, GidEntry, WrKind, choose_gid,
                                      gid_to_bytes, list_rdma_devices, make_wr_id)

log = logging.getLogger(__name__)
_SCRATCH_BYTES = 64
_SYSFS = "/sys/class/infiniband"


@dataclass(frozen=True, slots=True)
class PortInfo:
    """What the port says: ``state`` / ``link_layer`` as ibv enums, MTUs in bytes, the ``lid``
    (InfiniBand), the GID table and, for a usable port, the chosen index and why."""

    device: str
    port: int
    state: int
    link_layer: int
    active_mtu: int
    max_mtu: int
    lid: int
    gids: tuple[GidEntry, ...] = ()
    gid_index: int | None = None
    gid_reason: str = ""
    problem: str = ""

    @property
    def state_name(self) -> str:
        return PORT_STATES.get(self.state, str(self.state))

    @property
    def link_layer_name(self) -> str:
        return LINK_LAYERS.get(self.link_layer, str(self.link_layer))


def read_gid_table(ctx, device: str, port: int, size: int) -> tuple[GidEntry, ...]:
    """The port's non-empty GID entries from sysfs (``gids/<i>``, ``gid_attrs/types/<i>``,
    ``gid_attrs/ndevs/<i>``: the kernel's view, the same for every rdma-core), falling back to
    ``Context.query_gid`` / ``query_gid_type`` for each index when sysfs has no table."""
    base = f"{_SYSFS}/{device}/ports/{port}"
    entries = []
    for i in range(size):
        try:
            with open(f"{base}/gids/{i}") as f:
                gid = gid_to_bytes(f.read().strip())
        except OSError:
            gid = None
        if gid is None:
            try:
                gid = gid_to_bytes(ctx.query_gid(port, i).gid)
            except Exception:   # noqa: BLE001 - an index past the table: stop reading
                break
        if gid == bytes(16):
            continue   # an empty slot (tables are sized for the maximum, e.g. 1024 on rxe)
        entries.append(GidEntry(i, gid, _gid_type(ctx, base, port, i), _read(f"{base}/gid_attrs/ndevs/{i}")))
    return tuple(entries)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _gid_type(ctx, base: str, port: int, index: int) -> str:
    text = _read(f"{base}/gid_attrs/types/{index}")
    if text:
        return text
    try:
        value = ctx.query_gid_type(port, index)
    except Exception:   # noqa: BLE001 - unknown type
        return "unknown"
    return {0: "IB/RoCE v1", 1: "RoCE v2"}.get(int(value), f"type {value}")


def query_port(ctx, device: str, config: VerbsConfig) -> PortInfo:
    """The configured port of an open context, with the GID index chosen (or the configured one
    checked) and ``problem`` set when the port cannot carry RDMA traffic."""
    attr = ctx.query_port(config.port)
    active, max_mtu = MTU_BYTES.get(int(attr.active_mtu), 0), MTU_BYTES.get(int(attr.max_mtu), 0)
    link = int(attr.link_layer)
    gids = read_gid_table(ctx, device, config.port, int(attr.gid_tbl_len))
    info = PortInfo(device, config.port, int(attr.state), link, active, max_mtu, int(attr.lid), gids)
    if info.state != IBV_PORT_ACTIVE:
        return _with(info, problem=f"{device} port {config.port} is {info.state_name}, not ACTIVE "
                                   "(link down, or the netdev is down)")
    if config.gid_index >= 0:
        entry = next((g for g in gids if g.index == config.gid_index), None)
        if link == IBV_LINK_LAYER_ETHERNET and (entry is None or entry.gid == bytes(16)):
            return _with(info, problem=f"GID index {config.gid_index} of {device} port {config.port} is empty")
        return _with(info, gid_index=config.gid_index, gid_reason="configured")
    try:
        index, reason = choose_gid(gids, link)
    except NoRdmaDeviceError as exc:
        return _with(info, problem=f"{device} port {config.port}: {exc}")
    return _with(info, gid_index=index, gid_reason=reason)


def _with(info: PortInfo, **changes: object) -> PortInfo:
    from dataclasses import replace
    return replace(info, **changes)


@dataclass
class Device:
    """Open resources of one device (see the module docstring). Raises ``NoRdmaDeviceError`` /
    ``EngineUnavailableError`` from the constructor with the reason the device is unusable."""

    config: VerbsConfig
    name: str = ""
    port: PortInfo | None = None
    cq_fd: int | None = None
    async_fd: int | None = None
    _objs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        import_pyverbs()
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr

        names = list_rdma_devices()
        self.name = self.config.device or names[0]
        if self.name not in names:
            raise NoRdmaDeviceError(f"no RDMA device {self.name!r}; present: {', '.join(names)}")
        try:
            self.ctx, fds = new_event_fds(lambda: Context(name=self.name))
            self._objs.append(self.ctx)
            self.async_fd = fds[0] if len(fds) == 1 else None
            self.port = query_port(self.ctx, self.name, self.config)
            if self.port.problem:
                raise NoRdmaDeviceError(self.port.problem)
            self.pd = self._keep(PD(self.ctx))
            self.channel, fds = new_event_fds(lambda: CompChannel(self.ctx))
            self._objs.append(self.channel)
            self.cq_fd = comp_channel_fd(self.channel, fds)
            self.cq = self._keep(CQ(self.ctx, self.config.cq_depth, None, self.channel, 0))
            self.srq = self._keep(SRQ(self.pd, SrqInitAttr(SrqAttr(max_wr=self.config.srq_depth, max_sge=1))))
            self._scratch = torch.zeros(_SCRATCH_BYTES, dtype=torch.uint8)
            self._scratch_mr = self._keep(MR(self.pd, _SCRATCH_BYTES, IBV_ACCESS_LOCAL_WRITE,
                                             address=self._scratch.data_ptr()))
            self._recv_serial = 0
            self.refill(self.config.srq_depth)
            self.request_notify()
        except PyverbsError as exc:
            self.close()
            raise EngineUnavailableError(f"cannot set up {self.name}: {exc}") from exc
        except BaseException:
            self.close()
            raise
        if self.async_fd is not None:
            os.set_blocking(self.async_fd, False)
        if self.cq_fd is not None:
            os.set_blocking(self.cq_fd, False)

    def _keep(self, obj):
        self._objs.append(obj)
        return obj

    @property
    def gid(self) -> bytes:
        """Our GID (16 bytes) at the chosen index; zero on InfiniBand LID routing."""
        assert self.port is not None and self.port.gid_index is not None
        if self.port.link_layer != IBV_LINK_LAYER_ETHERNET:
            return bytes(16)
        return next(g.gid for g in self.port.gids if g.index == self.port.gid_index)

    @property
    def scratch_addr(self) -> int:
        """A registered 64-byte buffer (receive SGEs, drain markers); never read."""
        return self._scratch.data_ptr()

    @property
    def scratch_lkey(self) -> int:
        return int(self._scratch_mr.lkey)

    # -- receives -------------------------------------------------------------------------------
    def refill(self, count: int) -> None:
        """Post ``count`` receive WQEs to the SRQ as one chain. Raises ``TransferError``."""
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.wr import SGE, RecvWR

        if count <= 0:
            return
        sge = SGE(self._scratch.data_ptr(), _SCRATCH_BYTES, self._scratch_mr.lkey)
        wrs = [RecvWR(wr_id=make_wr_id(WrKind.RECV, self._recv_serial + i), num_sge=1, sg=[sge])
               for i in range(count)]
        self._recv_serial += count
        for a, b in zip(wrs, wrs[1:]):
            a.next_wr = b
        try:
            self.srq.post_recv(wrs[0])
        except PyverbsError as exc:
            raise TransferError(f"posting {count} receive WQEs to the SRQ failed: {exc}") from exc

    # -- completions and events -----------------------------------------------------------------
    def poll(self, max_entries: int) -> list:
        """Up to ``max_entries`` work completions; never blocks."""
        count, wcs = self.cq.poll(max_entries)
        return list(wcs[:count]) if count > 0 else []

    def request_notify(self) -> None:
        """Arm the CQ: the next completion makes :attr:`cq_fd` readable."""
        self.cq.req_notify()

    def consume_cq_event(self) -> None:
        """Read and acknowledge the channel's pending CQ event (after :attr:`cq_fd` was readable);
        nothing pending is fine (the fd is non-blocking)."""
        try:
            self.channel.get_cq_event(self.cq)
        except Exception:   # noqa: BLE001 - EAGAIN: no event pending
            return
        self.cq.ack_events(1)

    def read_async_event(self) -> int | None:
        """One pending async event's type (``ibv_event_type``), acknowledged; None if none."""
        from pyverbs.pyverbs_error import PyverbsError

        try:
            event = self.ctx.get_async_event()
        except PyverbsError:
            return None
        event_type = int(event.event_type)
        event.ack()
        return event_type

    def close(self) -> None:
        """Destroy the SRQ, CQ, channel, scratch MR, PD and context (reverse order). Idempotent."""
        errors = []
        while self._objs:
            obj = self._objs.pop()
            try:
                obj.close()
            except Exception as exc:   # noqa: BLE001 - keep releasing the rest
                errors.append(exc)
        if errors:
            log.warning("closing %s: %s", self.name, errors)


def async_event_name(event_type: int) -> str:
    """``IBV_EVENT_*`` name of an async event type (for logs)."""
    for name in ("CQ_ERR", "QP_FATAL", "QP_REQ_ERR", "QP_ACCESS_ERR", "COMM_EST", "SQ_DRAINED",
                 "PATH_MIG", "PATH_MIG_ERR", "DEVICE_FATAL", "PORT_ACTIVE", "PORT_ERR", "LID_CHANGE",
                 "PKEY_CHANGE", "SM_CHANGE", "SRQ_ERR", "SRQ_LIMIT_REACHED", "QP_LAST_WQE_REACHED",
                 "CLIENT_REREGISTER", "GID_CHANGE", "WQ_FATAL"):
        try:
            if enum(f"IBV_EVENT_{name}") == event_type:
                return name
        except EngineUnavailableError:
            break
    return f"event {event_type}"
