"""One RC queue pair of the verbs engine: creation on the shared CQ and SRQ, the
RESET -> INIT -> RTR -> RTS transitions, posting chains of writes, error and teardown.

State (:class:`QpState`, one transition function :meth:`RcQp.move`)::

    CONNECTING -> READY -> DRAINING -> DEAD
         \\___________________/^     (failed before READY)

READY: writes may be posted. DRAINING: the QP was moved to ERR (``ibv_modify_qp``; a QP that
reported an error completion is there already), its outstanding WRs complete with
``WR_FLUSH_ERR`` and a signaled drain marker posted after them completes last (completions of
one send queue arrive in order, IB spec vol. 1, 10.8.5); then nothing of it can still be in the
CQ or on the wire from our side, and it is destroyed (DEAD). A receiver's QP has no send WRs and
is destroyed straight from ERR.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from enum import IntEnum

from kvtransfer.config import VerbsConfig
from kvtransfer.errors import TransferError
from kvtransfer.verbs.compat import enum
from kvtransfer.verbs.support import (IBV_QPS_ERR, INIT_MASK, MTU_ENUM, QP_STATE, RTR_MASK, RTS_MASK, QpInfo,
                                      WriteWithImm, WrKind, init_attrs, make_wr_id, path_mtu, rtr_attrs,
                                      rts_attrs)


class QpState(IntEnum):
    CONNECTING = 0
    READY = 1
    DRAINING = 2
    DEAD = 3


_NEXT = {QpState.CONNECTING: {QpState.READY, QpState.DRAINING},
         QpState.READY: {QpState.DRAINING},
         QpState.DRAINING: {QpState.DEAD},
         QpState.DEAD: set()}


@dataclass(eq=False)
class RcQp:
    """A QP and its bookkeeping. ``owner`` is the outbound PeerId or the inbound writer's
    endpoint id; ``outstanding`` maps posted write wr_ids to their handles (under the engine's
    lock); ``psn`` is our initial send PSN."""

    qp: object
    owner: str
    psn: int
    qp_num: int   # cached: pyverbs reads it from the C struct, which is gone after close()
    state: QpState = QpState.CONNECTING
    outstanding: dict[int, int] = field(default_factory=dict)
    drain_deadline: float = 0.0

    def move(self, new: QpState) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"QP {self.qp_num}: {self.state.name} -> {new.name}")
        self.state = new


def create_qp(pd, cq, srq, config: VerbsConfig, owner: str) -> RcQp:
    """A new RC QP in RESET whose sends and receives complete on ``cq`` and whose receives come
    from ``srq``. Raises ``TransferError``."""
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPCap, QPInitAttr

    cap = QPCap(max_send_wr=config.send_queue_depth + 1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    try:
        qp = QP(pd, QPInitAttr(qp_type=enum("IBV_QPT_RC"), scq=cq, rcq=cq, srq=srq, cap=cap))
    except PyverbsError as exc:
        raise TransferError(f"cannot create an RC QP: {exc}") from exc
    return RcQp(qp, owner, int.from_bytes(os.urandom(3), "big"), int(qp.qp_num))


def local_info(rc: RcQp, gid: bytes, lid: int, mtu: int) -> QpInfo:
    """Our side of the connection record (``mtu``: configured, clamped to the port's active MTU)."""
    return QpInfo(rc.qp_num, rc.psn, gid, lid, mtu)


def connect_qp(rc: RcQp, remote: QpInfo, config: VerbsConfig, gid_index: int, active_mtu: int) -> int:
    """RESET -> INIT -> RTR -> RTS towards ``remote``; returns the path MTU used (bytes).

    The address vector is built as rdma-core's tests/base.py does: ``AHAttr(is_global=1,
    gr=GlobalRoute(dgid=GID(...), sgid_index=...))`` - pyverbs refuses a global AH without a
    ``GlobalRoute`` and takes the GID as a string. Raises ``TransferError``.
    """
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QPAttr

    mtu = path_mtu(config.mtu, active_mtu, remote.mtu)
    steps = ((init_attrs(config.port), INIT_MASK),
             (rtr_attrs(remote, mtu, config.port, gid_index, config.min_rnr_timer), RTR_MASK),
             (rts_attrs(rc.psn, config.timeout, config.retry_count, config.rnr_retry), RTS_MASK))
    try:
        for attrs, mask in steps:
            attr = QPAttr()
            for name, value in attrs.items():
                if name == "ah_attr":
                    gr = None
                    if value["is_global"]:
                        g = value["grh"]
                        gr = GlobalRoute(dgid=GID(g["dgid"]), flow_label=g["flow_label"],
                                         sgid_index=g["sgid_index"], hop_limit=g["hop_limit"],
                                         traffic_class=g["traffic_class"])
                    attr.ah_attr = AHAttr(dlid=value["dlid"], sl=value["sl"], src_path_bits=value["src_path_bits"],
                                          is_global=value["is_global"], port_num=value["port_num"], gr=gr)
                else:
                    setattr(attr, name, value)
            rc.qp.modify(attr, mask)
    except PyverbsError as exc:
        raise TransferError(f"QP {rc.qp_num}: state transition failed: {exc}") from exc
    assert mtu in MTU_ENUM
    return mtu


def to_error(rc: RcQp) -> None:
    """Move the QP to ERR (flushes its outstanding WRs). Errors are ignored: a QP that cannot be
    modified is destroyed next anyway."""
    from pyverbs.qp import QPAttr

    attr = QPAttr()
    attr.qp_state = IBV_QPS_ERR
    try:
        rc.qp.modify(attr, QP_STATE)
    except Exception:   # noqa: BLE001
        pass


def destroy(rc: RcQp) -> None:
    try:
        rc.qp.close()
    except Exception:   # noqa: BLE001 - the context's close releases it at the latest
        pass


_drain_ids = itertools.count(1)


def post_chain(rc: RcQp, writes: list[WriteWithImm]) -> None:
    """Post ``writes`` as one chain (one doorbell). Raises pyverbs' error; the caller treats a
    failed post as a QP error (which of the chain's WRs were posted is then found by draining)."""
    from pyverbs.wr import SGE, SendWR

    wrs = []
    for w in writes:
        sge = SGE(w.local_addr, w.length, w.lkey)
        wr = SendWR(wr_id=w.wr_id, opcode=w.opcode, num_sge=1, sg=[sge], send_flags=w.send_flags)
        wr.set_wr_rdma(w.rkey, w.remote_addr)
        if w.opcode == 1:
            wr.imm_data = w.imm_data
        wrs.append(wr)
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
    rc.qp.post_send(wrs[0])


def post_drain_marker(rc: RcQp, scratch_addr: int, lkey: int) -> int:
    """Post a signaled zero-byte-destination marker after everything else on an ERR QP; its
    (flush) completion comes after every earlier WR's. Returns its wr_id; raises pyverbs' error
    when the provider refuses posts in ERR (the caller then falls back to a deadline)."""
    from pyverbs.wr import SGE, SendWR

    wr_id = make_wr_id(WrKind.DRAIN, next(_drain_ids))
    sge = SGE(scratch_addr, 1, lkey)
    wr = SendWR(wr_id=wr_id, opcode=0, num_sge=1, sg=[sge], send_flags=2)
    wr.set_wr_rdma(0, 0)
    rc.qp.post_send(wr)
    return wr_id
