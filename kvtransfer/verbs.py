"""``verbs``: RDMA WRITE WITH IMMEDIATE over RC queue pairs (pyverbs, lazily imported).

Resources per engine: one device context, PD, completion channel + CQ (shared by sends and
receives), an SRQ kept stocked with ``srq_depth`` receive WQEs (each incoming WRITE_WITH_IMM
consumes one; the CQ thread re-posts one per consumed completion), memory regions registered
from the tensor's address (host memory, or CUDA memory for GPUDirect with nvidia-peermem).

Connection bootstrap (``connect``): TCP to the peer's advertised address, the shared-secret
handshake of :mod:`kvtransfer.auth`, then each side sends ``qps_per_peer`` :class:`QpInfo`
(QP number, PSN, GID, LID, MTU) and drives its QPs INIT -> RTR -> RTS with
:func:`~kvtransfer.verbs_support.rtr_attrs` / ``rts_attrs``. The bootstrap socket stays open as a
liveness channel: EOF on it means the peer is gone (receiver: ``arrivals.on_peer_lost``; writer:
pending handles fail).

Threads: ``kv-verbs-listen`` (bootstrap accepts), ``kv-verbs-boot-<n>`` (one per inbound peer,
blocks on its bootstrap socket), ``kv-verbs-cq`` (blocks in ``get_cq_event``; ``close()`` wakes it
with a zero-length write on a QP connected to itself).

Not exercised on the development host (no RDMA device); the device-free parts live in
:mod:`kvtransfer.verbs_support` and are unit-tested.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer import auth
from kvtransfer.base import ArrivalHandler, EngineStats, Memory, PeerId, TransferEngine, WriteCompletion, WriteHandle, WriteOp
from kvtransfer.config import EngineConfig
from kvtransfer.connection import Listener, Shared, ThreadGroup
from kvtransfer.endpoint import (EndpointInfo, MemoryRegion, TransportAddress, TransportKind,
                                 local_host_id)
from kvtransfer.errors import (KVTransferError, PeerLostError, RemoteAccessError, TransferError)
from kvtransfer.frame import recv_exact
from kvtransfer.immediate import from_network_u32
from kvtransfer.verbs_support import (IBV_WC_RECV_RDMA_WITH_IMM, QP_INFO_SIZE, QpInfo, import_pyverbs,
                                      init_attrs, list_rdma_devices, rdma_device_available, rtr_attrs,
                                      rts_attrs, write_with_imm)

__all__ = ["VerbsEngine", "rdma_device_available"]

_WAKE_WR_ID = (1 << 64) - 1


def gid_to_bytes(gid: str) -> bytes:
    return ipaddress.IPv6Address(gid).packed


def bytes_to_gid(raw: bytes) -> str:
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


@dataclass(slots=True)
class _Peer:
    info: EndpointInfo
    qps: list
    sock: socket.socket
    remote_addr: dict[int, int]


class VerbsEngine(TransferEngine):
    """RDMA engine; see the module docstring and :class:`TransferEngine` for the contracts."""

    name = "verbs"

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        list_rdma_devices()   # raises EngineUnavailableError / NoRdmaDeviceError with the reason
        import_pyverbs()
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.pd import PD
        from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr

        self._s = shared if shared is not None else Shared.create(config, arrivals)
        self._v = config.verbs
        names = list_rdma_devices()
        self._ctx = Context(name=self._v.device or names[0])
        self._pd = PD(self._ctx)
        self._channel = CompChannel(self._ctx)
        self._cq = CQ(self._ctx, self._v.cq_depth, None, self._channel, 0)
        self._cq.req_notify()
        self._srq = SRQ(self._pd, SrqInitAttr(SrqAttr(max_wr=self._v.srq_depth, max_sge=1)))
        for _ in range(self._v.srq_depth):
            self._post_recv()
        port = self._ctx.query_port(self._v.port)
        self._lid = port.lid
        self._gid = gid_to_bytes(self._ctx.query_gid(self._v.port, self._v.gid_index).gid)
        self._mrs: dict[int, tuple[object, MemoryRegion]] = {}
        self._lock = threading.Lock()
        self._peers: dict[PeerId, _Peer] = {}
        self._qp_source: dict[int, str] = {}
        self._wr_handles: dict[int, WriteHandle] = {}
        self._slots: dict[int, threading.Semaphore] = {}
        self._wr_ids = itertools.count(1)
        self._peer_ids = itertools.count(1)
        self._stop = threading.Event()
        self._closed = False
        self._threads = ThreadGroup()
        self._inbound: list[socket.socket] = []
        self._wake_qp = self._new_qp()
        self._connect_qp(self._wake_qp, self._qp_info(self._wake_qp, self._new_psn()))
        self._threads.start("kv-verbs-cq", self._run_cq)
        sock = socket.create_server((config.bind_host, config.port))
        self._port = sock.getsockname()[1]
        self._listener = Listener(sock, "kv-verbs-listen", self._threads, self._accept)

    # -- memory ---------------------------------------------------------------------------------
    def register_memory(self, memory: Memory, *, shared: object | None = None) -> MemoryRegion:
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE
        from pyverbs.mr import MR

        if isinstance(memory, torch.Tensor):
            if not memory.is_contiguous():
                raise TransferError("registered tensors must be contiguous")
            addr, length = memory.data_ptr(), memory.numel() * memory.element_size()
        else:
            addr, length = memory
        mr = MR(self._pd, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, address=addr)
        region = MemoryRegion(addr, length, mr.rkey)
        with self._lock:
            self._mrs[mr.rkey] = (mr, region)
        if not (isinstance(memory, torch.Tensor) and memory.device.type != "cpu"):
            self._s.memory.register(memory, shared, key=mr.rkey)   # visible to shm in ``auto``
        return region

    def deregister_memory(self, region: MemoryRegion) -> None:
        with self._lock:
            entry = self._mrs.pop(region.key, None)
        self._s.memory.deregister(region.key)
        if entry is not None:
            entry[0].close()

    def describe(self) -> EndpointInfo:
        with self._lock:
            regions = tuple(r for _, r in self._mrs.values())
        addr = TransportAddress(TransportKind.VERBS, host=self._s.config.host_for_peers, port=self._port)
        return EndpointInfo(self._s.endpoint_id, local_host_id(), regions, (addr,))

    # -- queue pairs ----------------------------------------------------------------------------
    def _new_qp(self):
        from pyverbs.enums import IBV_QPT_RC
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=self._v.send_queue_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        qp = QP(self._pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self._cq, rcq=self._cq, srq=self._srq, cap=cap))
        self._slots[qp.qp_num] = threading.Semaphore(self._v.send_queue_depth)
        return qp

    @staticmethod
    def _new_psn() -> int:
        return int.from_bytes(os.urandom(3), "big")

    def _qp_info(self, qp, psn: int) -> QpInfo:
        return QpInfo(qp.qp_num, psn, self._gid, self._lid, self._v.mtu)

    def _connect_qp(self, qp, remote: QpInfo, local_psn: int | None = None) -> None:
        from pyverbs.addr import GID, AHAttr
        from pyverbs.qp import QPAttr
        import pyverbs.enums as e

        psn = remote.psn if local_psn is None else local_psn
        for attrs, mask in (
            (init_attrs(self._v.port), e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS),
            (rtr_attrs(remote, self._v.mtu, self._v.port, self._v.gid_index),
             e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
             | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER),
            (rts_attrs(psn, self._v.timeout, self._v.retry_count, self._v.rnr_retry),
             e.IBV_QP_STATE | e.IBV_QP_SQ_PSN | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
             | e.IBV_QP_MAX_QP_RD_ATOMIC),
        ):
            attr = QPAttr()
            for name, value in attrs.items():
                if name == "ah_attr":
                    ah = AHAttr(port_num=value["port_num"], is_global=value["is_global"], dlid=value["dlid"],
                                sl=value["sl"], src_path_bits=value["src_path_bits"])
                    if value["is_global"]:
                        ah.dgid = GID(bytes_to_gid(value["dgid"]))
                        ah.sgid_index, ah.hop_limit = value["sgid_index"], value["hop_limit"]
                    attr.ah_attr = ah
                else:
                    setattr(attr, name, value)
            qp.modify(attr, mask)

    def _post_recv(self) -> None:
        from pyverbs.wr import RecvWR
        self._srq.post_recv(RecvWR(wr_id=0, num_sge=0))

    # -- bootstrap ------------------------------------------------------------------------------
    def _exchange(self, sock: socket.socket, qps: list) -> list[QpInfo]:
        psns = [self._new_psn() for _ in qps]
        sock.sendall(b"".join(self._qp_info(qp, psn).to_bytes() for qp, psn in zip(qps, psns)))
        buf = memoryview(bytearray(QP_INFO_SIZE * len(qps)))
        if not recv_exact(sock, buf):
            raise TransferError("peer closed during the QP exchange")
        remote = [QpInfo.from_bytes(bytes(buf[i * QP_INFO_SIZE:(i + 1) * QP_INFO_SIZE])) for i in range(len(qps))]
        for qp, psn, info in zip(qps, psns, remote):
            self._connect_qp(qp, info, psn)
        return remote

    def _accept(self, sock: socket.socket) -> None:
        self._threads.start(f"kv-verbs-boot-{len(self._inbound)}", self._serve_bootstrap, sock)

    def _serve_bootstrap(self, sock: socket.socket) -> None:
        self._inbound.append(sock)
        source = ""
        try:
            sock.settimeout(self._s.config.connect_timeout_s)
            source = auth.server_handshake(sock, self._s.config.secret)
            qps = [self._new_qp() for _ in range(self._v.qps_per_peer)]
            self._exchange(sock, qps)
            with self._lock:
                self._qp_source.update({qp.qp_num: source for qp in qps})
            sock.settimeout(None)
            while sock.recv(1 << 12):
                pass
            raise PeerLostError("bootstrap connection closed")
        except (OSError, KVTransferError) as exc:
            if source and not self._stop.is_set():
                self._s.counters.add(peers_lost=1)
                self._s.arrivals.on_peer_lost(source, PeerLostError(f"writer {source}: {exc}"))
            elif not source:
                self._s.counters.add(auth_failures=1)
        finally:
            sock.close()

    def connect(self, peer: EndpointInfo) -> PeerId:
        addr = peer.transport(TransportKind.VERBS)
        if addr is None:
            raise TransferError(f"peer {peer.endpoint_id} offers no verbs transport")
        sock = socket.create_connection((addr.host, addr.port), timeout=self._s.config.connect_timeout_s)
        try:
            auth.client_handshake(sock, self._s.config.secret, self._s.endpoint_id)
            qps = [self._new_qp() for _ in range(self._v.qps_per_peer)]
            self._exchange(sock, qps)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        peer_id = PeerId(f"verbs:{next(self._peer_ids)}")
        with self._lock:
            self._peers[peer_id] = _Peer(peer, qps, sock, {r.key: r.addr for r in peer.regions})
        return peer_id

    # -- data path ------------------------------------------------------------------------------
    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        from pyverbs.wr import SGE, SendWR
        import pyverbs.enums as e

        with self._lock:
            state = self._peers.get(peer)
        if state is None:
            raise TransferError(f"unknown peer {peer}")
        nbytes = sum(op.length for op in ops)
        handle = self._s.tracker.new(peer, len(ops), len(ops), nbytes)
        self._s.counters.add(writes_posted=len(ops), bytes_posted=nbytes)
        for i, op in enumerate(ops):
            mr, local = self._mrs.get(op.local.key, (None, None))
            remote_base = state.remote_addr.get(op.remote_key)
            if mr is None or remote_base is None:
                self._s.tracker.part_done(handle, RemoteAccessError(f"unknown key in {op}"))
                continue
            qp = state.qps[i % len(state.qps)]
            fields = write_with_imm(next(self._wr_ids), local.addr + op.local_offset, op.length, mr.lkey,
                                    remote_base + op.remote_offset, op.remote_key, op.imm or 0)
            wr = SendWR(wr_id=fields.wr_id, num_sge=1, sg=[SGE(fields.local_addr, fields.length, fields.lkey)],
                        opcode=fields.opcode if op.imm is not None else e.IBV_WR_RDMA_WRITE,
                        send_flags=fields.send_flags)
            wr.set_wr_rdma(fields.rkey, fields.remote_addr)
            if op.imm is not None:
                wr.imm_data = fields.imm_data
            self._slots[qp.qp_num].acquire()
            with self._lock:
                self._wr_handles[fields.wr_id] = (handle, qp.qp_num)
            qp.post_send(wr)
        return handle

    def _run_cq(self) -> None:
        import pyverbs.enums as e

        while not self._stop.is_set():
            self._channel.get_cq_event(self._cq)
            self._cq.ack_events(1)
            self._cq.req_notify()
            while True:
                count, wcs = self._cq.poll(64)
                if count == 0:
                    break
                for wc in wcs:
                    self._on_wc(wc, e)

    def _on_wc(self, wc, e) -> None:
        if wc.wr_id == _WAKE_WR_ID or (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM and wc.qp_num == self._wake_qp.qp_num):
            if wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM:
                self._post_recv()
            return
        if wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM:
            self._post_recv()
            source = self._qp_source.get(wc.qp_num, "")
            if wc.status == e.IBV_WC_SUCCESS:
                self._s.counters.add(writes_received=1, bytes_received=wc.byte_len)
                self._s.arrivals.on_immediate(from_network_u32(wc.imm_data), source)
            return
        with self._lock:
            handle, qp_num = self._wr_handles.pop(wc.wr_id, (None, None))
        if handle is None:
            return
        self._slots[qp_num].release()
        error = None
        if wc.status == e.IBV_WC_REM_ACCESS_ERR:
            error = RemoteAccessError(f"remote access error (wr {wc.wr_id})")
        elif wc.status != e.IBV_WC_SUCCESS:
            error = PeerLostError(f"work completion status {wc.status} (vendor {wc.vendor_err})")
        self._s.tracker.part_done(handle, error)

    def _wake(self) -> None:
        from pyverbs.wr import SendWR
        import pyverbs.enums as e

        wr = SendWR(wr_id=_WAKE_WR_ID, num_sge=0, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(0, 0)
        wr.imm_data = 0
        self._wake_qp.post_send(wr)

    # -- rest of the interface ------------------------------------------------------------------
    def poll(self) -> list[WriteCompletion]:
        return self._s.tracker.poll()

    def wait(self, handle: WriteHandle, timeout_s: float | None = None) -> WriteCompletion:
        return self._s.tracker.wait(handle, timeout_s)

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            state = self._peers.pop(peer, None)
        if state is None:
            return
        state.sock.close()
        for qp in state.qps:
            qp.close()
        self._s.tracker.fail_peer(peer, PeerLostError(f"disconnected from {peer}"))

    def stats(self) -> EngineStats:
        return self._s.counters.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            self.disconnect(peer)
        self._stop.set()
        self._listener.close()
        for sock in list(self._inbound):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wake()
        alive = self._threads.join_all(self._s.config.close_timeout_s)
        self._s.tracker.fail_all(TransferError("engine closed"))
        for obj in [self._wake_qp, self._srq, self._cq, self._channel] + [m for m, _ in self._mrs.values()] + [self._pd, self._ctx]:
            obj.close()
        if alive:
            raise TransferError(f"threads did not stop: {alive}")
