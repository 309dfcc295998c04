"""``verbs``: RDMA WRITE WITH IMMEDIATE over RC queue pairs (pyverbs, lazily imported).

Pieces: :mod:`~kvtransfer.verbs.device` (context, PD, CQ, SRQ, port and GID),
:mod:`~kvtransfer.verbs.memory` (registered memory), :mod:`~kvtransfer.verbs.qp` (one QP's
states), :mod:`~kvtransfer.verbs.links` (a connection's QP set), :mod:`~kvtransfer.verbs.writer`
(outbound peers and posting; the writer's peer lifecycle), :mod:`~kvtransfer.verbs.receiver`
(inbound connections; what a writer's death means), :mod:`~kvtransfer.verbs.cq` (the completion
loop: CQ, budget, teardown), :mod:`~kvtransfer.verbs.bootstrap` (handshakes, the socket watch),
:mod:`~kvtransfer.verbs.gpu` (CUDA registration and flush), :mod:`~kvtransfer.verbs.compat`
(pyverbs releases). This module is the engine: it builds and owns those pieces, implements the
:class:`TransferEngine` contract with them, and closes them in order.

Threads: ``kv-verbs-listen``, ``kv-verbs-accept-<n>``, ``kv-verbs-peers``, ``kv-verbs-cq``,
``kv-verbs-reconnect-<peer>``; all stopped and joined by ``close()``.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Sequence

from kvtransfer.base import ArrivalHandler, EngineStats, Memory, PeerId, TransferEngine, WriteCompletion, WriteHandle, WriteOp
from kvtransfer.config import EngineConfig
from kvtransfer.connection import Listener, Shared, ThreadGroup
from kvtransfer.endpoint import EndpointInfo, MemoryRegion, TransportAddress, TransportKind, local_host_id
from kvtransfer.errors import KVTransferError, TransferError
from kvtransfer.verbs.bootstrap import SocketWatch
from kvtransfer.verbs.cq import CompletionLoop
from kvtransfer.verbs.device import Device
from kvtransfer.verbs.links import QpLinks
from kvtransfer.verbs.memory import MemoryTable
from kvtransfer.verbs.qp import destroy
from kvtransfer.verbs.receiver import Receivers
from kvtransfer.verbs.writer import Writers

__all__ = ["VerbsEngine"]
log = logging.getLogger(__name__)


class VerbsEngine(TransferEngine):
    """RDMA engine; see the module docstring and :class:`TransferEngine` for the contracts.

    Raises from the constructor: ``EngineUnavailableError`` (no pyverbs), ``NoRdmaDeviceError``
    (no device, the named device is absent, its port is not ACTIVE, its GID table is empty),
    ``TransferError`` (the bootstrap listener cannot bind).
    """

    name = "verbs"

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        self._s = shared if shared is not None else Shared.create(config, arrivals)
        self._cfg = config
        self._dev = Device(config.verbs)
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadGroup()
        self._mem = MemoryTable(self._dev, self._s)
        self._loop: CompletionLoop | None = None
        self._watch: SocketWatch | None = None
        self._listener: Listener | None = None
        try:
            self._loop = CompletionLoop(self._dev, self._s, config.verbs, self._threads, self._on_broken,
                                        config.close_timeout_s)
            self._watch = SocketWatch(self._threads, "kv-verbs-peers", config.connect_timeout_s)
            links, ids = QpLinks(self._dev, config.verbs, self._loop), itertools.count(1)
            self._writers = Writers(config, self._s, self._mem, links, self._loop, self._watch, self._threads, ids)
            self._receivers = Receivers(config, self._s, links, self._loop, self._watch, self._threads, ids)
            try:
                sock = socket.create_server((config.bind_host, config.port))
            except OSError as exc:
                raise TransferError(f"cannot listen on {config.bind_host}:{config.port}: {exc}") from exc
            self._port = sock.getsockname()[1]
            self._listener = Listener(sock, "kv-verbs-listen", self._threads, self._receivers.accept)
        except BaseException:
            self._stop_threads()
            self._dev.close()
            raise
        port = self._dev.port
        log.info("verbs engine on %s port %d: GID index %s (%s), active MTU %d", self._dev.name, port.port,
                 port.gid_index, port.gid_reason, port.active_mtu)

    @property
    def device(self) -> Device:
        """The opened device (name, port info, chosen GID)."""
        return self._dev

    # -- memory ---------------------------------------------------------------------------------
    def register_memory(self, memory: Memory, *, shared: object | None = None) -> MemoryRegion:
        """Host memory: ``ibv_reg_mr`` (also entered in the shared memory table, so shm in
        ``auto`` sees it). CUDA memory: dma-buf, else nvidia-peermem
        (:func:`kvtransfer.verbs.gpu.register_cuda`; the region's ``addr`` is then the MR's
        iova). Raises ``TransferError`` (``GpuRegistrationError`` for CUDA memory)."""
        self._check_open()
        return self._mem.register(memory, shared)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._mem.deregister(region)

    def describe(self) -> EndpointInfo:
        addr = TransportAddress(TransportKind.VERBS, host=self._cfg.host_for_peers, port=self._port)
        return EndpointInfo(self._s.endpoint_id, local_host_id(), self._mem.regions(), (addr,))

    def flush_arrivals(self) -> None:
        """After a slot's count completed on a CUDA region: ``cuFlushGPUDirectRDMAWrites`` on each
        CUDA device with a registered region, so kernels launched next read the written bytes.
        Nothing to do for host memory. Raises ``GpuRegistrationError`` if the driver refuses."""
        devices = self._mem.cuda_devices()
        if devices:
            from kvtransfer.verbs.gpu import flush_gpudirect_writes
            for device in devices:
                flush_gpudirect_writes(device)

    # -- writer (kvtransfer.verbs.writer) -----------------------------------------------------------
    def connect(self, peer: EndpointInfo) -> PeerId:
        self._check_open()
        return self._writers.connect(peer)

    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        return self._writers.post_writes(peer, ops)

    def disconnect(self, peer: PeerId) -> None:
        self._writers.disconnect(peer)

    def _on_broken(self, owner: str, error: KVTransferError) -> None:
        self._writers.on_broken(owner, error)

    # -- rest of the interface ------------------------------------------------------------------
    def poll(self) -> list[WriteCompletion]:
        return self._s.tracker.poll()

    def wait(self, handle: WriteHandle, timeout_s: float | None = None) -> WriteCompletion:
        return self._s.tracker.wait(handle, timeout_s)

    def stats(self) -> EngineStats:
        return self._s.counters.snapshot()

    def qp_states(self) -> dict[int, str]:
        """qp_num -> state of every QP not yet destroyed (tests, diagnostics)."""
        return self._loop.qp_states()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._receivers.refuse_new()
        self._writers.close()
        self._receivers.close()
        alive = self._stop_threads()
        self._s.tracker.fail_all(TransferError("engine closed"))
        for rc in self._loop.leftover_qps():
            destroy(rc)
        self._mem.close()
        self._dev.close()
        if alive:
            raise TransferError(f"threads did not stop: {alive}")

    def _stop_threads(self) -> list[str]:
        if self._listener is not None:
            self._listener.close()
        if self._watch is not None:
            self._watch.close()
        if self._loop is not None:
            self._loop.stop()
        alive = self._threads.join_all(self._cfg.close_timeout_s)
        if self._watch is not None:
            self._watch.close_fds()
        if self._loop is not None:
            self._loop.close_fds()
        return alive

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
