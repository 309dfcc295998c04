"""The verbs engine's QP sets: the RC queue pairs of one connection (a writer's peer or a
receiver's inbound writer), created on the device's shared CQ and SRQ, described for the
bootstrap exchange, driven to RTS towards the remote side's records and then handed to the
completion loop, which owns them from there on (teardown included)."""

from __future__ import annotations

from collections.abc import Callable

from kvtransfer.config import VerbsConfig
from kvtransfer.verbs.cq import CompletionLoop
from kvtransfer.verbs.device import Device
from kvtransfer.verbs.qp import QpState, RcQp, connect_qp, create_qp, destroy, local_info
from kvtransfer.verbs.support import QpInfo


class QpLinks:
    """Creates and connects the QP sets of every connection of one engine."""

    def __init__(self, device: Device, config: VerbsConfig, loop: CompletionLoop) -> None:
        self._dev, self._v, self._loop = device, config, loop

    def new(self, owner: str, count: int) -> list[RcQp]:
        """``count`` fresh QPs (state CONNECTING) for ``owner``; none are left behind on failure."""
        qps: list[RcQp] = []
        try:
            for _ in range(count):
                qps.append(create_qp(self._dev.pd, self._dev.cq, self._dev.srq, self._v, owner))
        except BaseException:
            for rc in qps:
                destroy(rc)
            raise
        return qps

    def infos(self, qps: list[RcQp]) -> list[QpInfo]:
        """Our connection records for ``qps``, as the bootstrap exchange sends them."""
        port = self._dev.port
        mtu = min(self._v.mtu, port.active_mtu)
        return [local_info(rc, self._dev.gid, port.lid, mtu) for rc in qps]

    def connect(self, qps: list[RcQp], remote: list[QpInfo], inbound_source: str | None = None,
                at_rts: Callable[[], None] | None = None) -> None:
        """Drive ``qps`` to RTS towards ``remote``, call ``at_rts``, then hand them to the
        completion loop (``inbound_source``: the writer they receive from, on a receiver)."""
        port = self._dev.port
        for rc, info in zip(qps, remote, strict=True):
            connect_qp(rc, info, self._v, port.gid_index, port.active_mtu)
        if at_rts is not None:
            at_rts()
        for rc in qps:
            self._loop.add(rc, inbound_source)

    @staticmethod
    def discard_unconnected(qps: list[RcQp]) -> None:
        """Destroy those of ``qps`` the completion loop never took (still CONNECTING)."""
        for rc in qps:
            if rc.state == QpState.CONNECTING:
                destroy(rc)
