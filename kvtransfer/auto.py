"""``auto``: a primary engine (verbs when an RDMA device exists, else tcp) plus shm for peers on the
same host, and cuda_ipc between two GPU pools on the same host (when a CUDA pool is registered and
cupy runs). Both share one memory table, one completion tracker and one arrival handler, so keys,
handles and immediates are the same whichever path a peer uses.

Choosing the primary (:func:`choose_primary`): no pyverbs or no RDMA device -> tcp; otherwise
the verbs engine is built, and if that fails for any reason (port down, no usable GID, memlock,
a pyverbs error) the reason is logged and tcp is used: a worker never fails to start because
its RDMA set-up did. :attr:`AutoEngine.choice` says which and why (``pdserve doctor`` shows it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtransfer.base import (ArrivalHandler, EngineStats, Memory, PeerId, TransferEngine,
                             WriteCompletion, WriteHandle, WriteOp)
from kvtransfer.config import EngineConfig
from kvtransfer.connection import Shared
from kvtransfer.endpoint import EndpointInfo, MemoryRegion, local_host_id
from kvtransfer.errors import EngineUnavailableError, TransferError
from kvtransfer.shm import ShmEngine

log = logging.getLogger(__name__)

PrimaryFactory = Callable[[EngineConfig, Shared], TransferEngine]


@dataclass(frozen=True, slots=True)
class PrimaryChoice:
    """Which engine carries ``auto``'s off-host peers (``"verbs"`` or ``"tcp"``) and why."""

    name: str
    reason: str


def choose_primary(config: EngineConfig, shared: Shared) -> tuple[TransferEngine, PrimaryChoice]:
    """Build the primary engine (see the module docstring). Raises only what tcp raises."""
    from kvtransfer.tcp import TcpEngine
    from kvtransfer.verbs.support import list_rdma_devices

    try:
        list_rdma_devices()
    except EngineUnavailableError as exc:
        log.info("transfer engine auto: tcp (%s)", exc)
        return TcpEngine(config, shared=shared), PrimaryChoice("tcp", f"verbs not possible: {exc}")
    try:
        from kvtransfer.verbs.engine import VerbsEngine
        engine = VerbsEngine(config, shared=shared)
    except Exception as exc:   # noqa: BLE001 - whatever broke verbs set-up, the worker falls back
        log.warning("transfer engine auto: verbs set-up failed (%s: %s); falling back to tcp",
                    type(exc).__name__, exc)
        return TcpEngine(config, shared=shared), PrimaryChoice("tcp", f"verbs set-up failed: {exc}")
    port = engine.device.port
    reason = (f"{engine.device.name} port {port.port} {port.state_name} ({port.link_layer_name}), GID index "
              f"{port.gid_index} ({port.gid_reason}), active MTU {port.active_mtu}")
    log.info("transfer engine auto: verbs on %s", reason)
    return engine, PrimaryChoice("verbs", reason)


class AutoEngine(TransferEngine):
    """Routes each peer to shm when it is on this host and exports all its regions there,
    otherwise to the primary engine. See :class:`TransferEngine` for the contracts."""

    name = "auto"

    def __init__(self, config: EngineConfig, primary: PrimaryFactory | None = None,
                 arrivals: ArrivalHandler | None = None) -> None:
        self._s = Shared.create(config, arrivals)
        if primary is None:
            self._primary, self.choice = choose_primary(config, self._s)
        else:
            self._primary = primary(config, self._s)
            self.choice = PrimaryChoice(self._primary.name, "given")
        try:
            self._shm = ShmEngine(config, shared=self._s) if config.enable_shm else None
        except BaseException:
            self._primary.close()
            raise
        self._routes: dict[PeerId, TransferEngine] = {}
        self._ipc = None   # a CudaIpcEngine, built when a CUDA pool is registered

    @property
    def primary(self) -> TransferEngine:
        return self._primary

    def register_memory(self, memory: Memory, *, shared: object | None = None, stage: bool = False) -> MemoryRegion:
        """The primary's registration; a CUDA tensor (any tensor with ``stage``) with a tcp primary
        is staged through a host mirror in shared memory (`kvtransfer.staging`), so same-host
        peers still use shm, and a CUDA one is exported over cuda_ipc too."""
        if isinstance(memory, torch.Tensor) and (memory.is_cuda or stage):
            if self._primary.name == "tcp":   # the table is shared: tcp sees shm's registration
                engine = self._shm if self._shm is not None else self._primary
                region = engine.register_memory(memory, stage=True)
            else:
                region = self._primary.register_memory(memory, shared=shared)
            if memory.is_cuda:
                self._export_ipc(memory, region.key)
            return region
        return self._primary.register_memory(memory, shared=shared)

    def _export_ipc(self, memory: torch.Tensor, key: int) -> None:
        """Export a CUDA pool over cuda_ipc too, under the same key (same-host GPU peers copy
        device to device); without cupy or when the export fails, the reason is logged."""
        if not self._s.config.enable_shm:
            return
        try:
            if self._ipc is None:
                from kvtransfer.cuda_ipc import CudaIpcEngine
                self._ipc = CudaIpcEngine(self._s.config, shared=self._s)
            self._ipc.export(memory, key)
        except (EngineUnavailableError, TransferError) as exc:
            log.warning("transfer engine auto: no cuda_ipc for this CUDA pool (%s)", exc)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._primary.deregister_memory(region)
        if self._shm is not None:
            self._shm.deregister_memory(region)   # a staged mirror it allocated (idempotent otherwise)
        if self._ipc is not None:
            self._ipc.deregister_memory(region)

    def describe(self) -> EndpointInfo:
        """The primary's regions (verbs: every MR, CUDA ones included, at the address peers
        must write to), plus host regions only the shared table knows; shm's and the primary's
        transports."""
        primary = self._primary.describe()
        regions = {r.key: r for r in self._s.memory.regions()}
        regions.update({r.key: r for r in primary.regions})
        transports = primary.transports
        if self._shm is not None:
            transports = self._shm.describe().transports + transports
        if self._ipc is not None:
            transports = self._ipc.describe().transports + transports
        return EndpointInfo(self._s.endpoint_id, local_host_id(), tuple(regions.values()), transports)

    def flush_arrivals(self) -> None:
        self._primary.flush_arrivals()

    def connect(self, peer: EndpointInfo) -> PeerId:
        if self._ipc is not None:
            from kvtransfer.cuda_ipc import CudaIpcEngine
            if CudaIpcEngine.reachable(peer):
                try:
                    peer_id = self._ipc.connect(peer)
                    self._routes[peer_id] = self._ipc
                    return peer_id
                except TransferError as exc:
                    log.warning("cuda_ipc to %s failed (%s); trying the others", peer.endpoint_id, exc)
        if self._shm is not None and ShmEngine.reachable(peer):
            try:
                peer_id = self._shm.connect(peer)
                if self._shm.exported_keys(peer) >= {r.key for r in peer.regions}:
                    self._routes[peer_id] = self._shm
                    return peer_id
                self._shm.disconnect(peer_id)
            except TransferError as exc:
                log.warning("shm to %s failed (%s); using %s", peer.endpoint_id, exc, self._primary.name)
        peer_id = self._primary.connect(peer)
        self._routes[peer_id] = self._primary
        return peer_id

    def route(self, peer: PeerId) -> str:
        """Name of the engine carrying ``peer`` (``"cuda_ipc"``, ``"shm"``, ``"tcp"``, ``"verbs"``)."""
        return self._engine(peer).name

    def post_writes(self, peer: PeerId, ops: Sequence[WriteOp]) -> WriteHandle:
        return self._engine(peer).post_writes(peer, ops)

    def poll(self) -> list[WriteCompletion]:
        return self._s.tracker.poll()

    def wait(self, handle: WriteHandle, timeout_s: float | None = None) -> WriteCompletion:
        return self._s.tracker.wait(handle, timeout_s)

    def disconnect(self, peer: PeerId) -> None:
        engine = self._routes.pop(peer, None)
        if engine is not None:
            engine.disconnect(peer)

    def stats(self) -> EngineStats:
        return self._s.counters.snapshot()

    def close(self) -> None:
        try:
            if self._ipc is not None:
                self._ipc.close()
        finally:
            try:
                if self._shm is not None:
                    self._shm.close()
            finally:
                self._primary.close()

    def _engine(self, peer: PeerId) -> TransferEngine:
        engine = self._routes.get(peer)
        if engine is None:
            raise TransferError(f"unknown peer {peer}")
        return engine
