"""``cuda_ipc``: writes between GPU pools on one host, through CUDA IPC (NIXL's cuda_ipc backend is
the anchor; the CUDA runtime's "Interprocess Communication" API, through cupy).

Receiver: ``register_memory(cuda_tensor)`` exports the region as the CUDA IPC memory handle of the
allocation holding it (``cudaIpcGetMemHandle`` on its base, `kvtransfer.verbs.gpu.allocation_range`:
a handle names a whole allocation) with the region's offset in it, its length, key and device
(`IpcExport`). A writer on this host connects to the engine's abstract Unix socket and
authenticates with the cluster secret (tcp's handshake); only then does it receive the export table
(`encode_exports`) and open each allocation once (``cudaIpcOpenMemHandle``, lazy peer access).

Writer: a batch's writes become device-to-device copies (`copy_plan`: per pair of local and peer
region, runs contiguous on both sides merged), all of a pair's in one launch of
`kvtransfer.copy_kernel.copy_ranges` (a lone range, or no Triton: ``cudaMemcpyAsync``), on the
stream thread's own CUDA stream, followed by a CUDA event. Only once that event has completed does
a NOTIFY frame carry the batch's descriptors to the receiver, which checks them against its exports
again and delivers the immediates, counted as every engine's are. An immediate therefore means the
bytes are in the reader's pool. Keys and bounds are checked by the writer before any copy (as
shm's: no NIC checks them). The stream thread does not wait for a group's event before it launches
the next queued group's copies (at most `IN_FLIGHT` groups), so the copy engine is not idle while
Python plans the next group; with nothing queued it waits for every event and sends their NOTIFYs
in order (`_IpcSender`).

Closing: a stream's thread waits for the copies it issued before it sends their NOTIFY, and
before BYE, so a close that joins the threads returns with no copy in flight; the peer's
allocations are closed (``cudaIpcCloseMemHandle``) when the writer disconnects.

Needs cupy and a CUDA device (`EngineUnavailableError` otherwise). The export table and the copy
plan are plain functions, tested on the CPU.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer import copy_kernel
from kvtransfer.base import ArrivalHandler, Memory, WriteOp, merged_ranges, write_arrays
from kvtransfer.config import EngineConfig
from kvtransfer.connection import InboundConnection, OutboundStream, Shared
from kvtransfer.endpoint import EndpointInfo, MemoryRegion, TransportAddress, TransportKind, local_host_id
from kvtransfer.errors import EngineUnavailableError, RemoteAccessError, TransferError
from kvtransfer.frame import T_NOTIFY, CheckedDescs, group_frames, recv_exact
from kvtransfer.memory import MemoryTable
from kvtransfer.software import OutboundPeer, SoftwareEngine, check_remote_ranges
from kvtransfer.staging import home_bytes

IPC_HANDLE_BYTES = 64   # sizeof(cudaIpcMemHandle_t)
IPC_LAZY_PEER_ACCESS = 1   # cudaIpcMemLazyEnablePeerAccess (CUDA runtime API, driver_types.h)
_LEN = struct.Struct("!I")
_MAX_TABLE = 1 << 20
IN_FLIGHT = 2
"""Groups of copies a stream thread has launched and not yet notified, at most."""


@dataclass(frozen=True, slots=True)
class IpcExport:
    """One exported region: ``handle`` the allocation's CUDA IPC handle, ``offset`` the region's
    first byte in that allocation, ``length`` bytes, ``device`` the CUDA device index."""

    key: int
    handle: bytes
    offset: int
    length: int
    device: int


def encode_exports(exports: Sequence[IpcExport]) -> bytes:
    """The export table as sent to an authenticated writer: a 4-byte length, then JSON."""
    body = json.dumps([[e.key, base64.b64encode(e.handle).decode(), e.offset, e.length, e.device]
                       for e in exports]).encode()
    return _LEN.pack(len(body)) + body


def decode_exports(body: bytes) -> list[IpcExport]:
    """Parse an export table's JSON (after its length). Raises TransferError when malformed: a
    handle that is not `IPC_HANDLE_BYTES` long, a negative offset, a non-positive length."""
    try:
        rows = json.loads(body)
        exports = [IpcExport(int(k), base64.b64decode(h, validate=True), int(o), int(n), int(d))
                   for k, h, o, n, d in rows]
    except (ValueError, TypeError) as exc:
        raise TransferError(f"malformed cuda_ipc export table: {exc}") from exc
    for e in exports:
        if len(e.handle) != IPC_HANDLE_BYTES or e.offset < 0 or e.length <= 0 or e.device < 0:
            raise TransferError(f"malformed cuda_ipc export of key {e.key:#x}")
    return exports


def copy_plan(ops: Sequence[WriteOp]) -> dict[tuple[int, int], np.ndarray]:
    """The device copies for ``ops``: per ``(local key, peer key)``, an int64 array of shape
    ``(copies, 3)`` of ``(peer offset, local offset, bytes)`` in the order of the writes,
    consecutive writes contiguous on both sides merged into one copy (the form
    `kvtransfer.copy_kernel.copy_ranges` takes). The ranges were checked
    (`CudaIpcEngine._check_remote`, `SoftwareEngine._check_local`). A `WriteOps` is merged from its
    arrays, without a Python object per write."""
    if (arrays := write_arrays(ops)) is not None:
        return {(ops.local.key, ops.remote_key): merged_ranges(arrays)}
    out: dict[tuple[int, int], list[list[int]]] = {}
    for op in ops:
        runs = out.setdefault((op.local.key, op.remote_key), [])
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == op.remote_offset and last[1] + last[2] == op.local_offset:
            last[2] += op.length
        else:
            runs.append([op.remote_offset, op.local_offset, op.length])
    return {pair: np.array(runs, dtype=np.int64).reshape(-1, 3) for pair, runs in out.items()}


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise EngineUnavailableError(f"cuda_ipc needs cupy: {exc}") from exc
    if not torch.cuda.is_available():
        raise EngineUnavailableError("cuda_ipc needs a CUDA device; torch sees none")
    return cupy


class CudaIpcEngine(SoftwareEngine):
    """The cuda_ipc engine (module doc). Registers CUDA tensors only; listens from construction
    until ``close()``. ``shared``: an `AutoEngine`'s tables, so keys and immediates are its own."""

    name = "cuda_ipc"

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        self._cp = _cupy()
        super().__init__(config, arrivals, shared)
        self._exports = MemoryTable()   # device registrations, each with its IpcExport
        self._opened: dict[str, list[int]] = {}   # peer endpoint id -> opened allocation bases
        self._remote: dict[str, dict[int, torch.Tensor]] = {}   # peer -> key -> its region's bytes, opened
        self._lengths: dict[str, dict[int, int]] = {}
        self._path = f"@pdserve-kv-ipc-{self._s.endpoint_id}"
        self._listen_unix(self._path)

    @staticmethod
    def reachable(info: EndpointInfo) -> bool:
        """True when ``info`` offers cuda_ipc and runs on this host."""
        return info.transport(TransportKind.CUDA_IPC) is not None and info.host_id == local_host_id()

    def _transport(self) -> TransportAddress:
        return TransportAddress(TransportKind.CUDA_IPC, path=self._path)

    # -- memory ---------------------------------------------------------------------------------
    def register_memory(self, memory: Memory, *, shared: object | None = None, stage: bool = False) -> MemoryRegion:
        """Export a contiguous CUDA tensor (module doc). Raises TransferError for other memory
        or when the driver refuses the export."""
        self._check_open()
        return self.export(memory).region

    def export(self, tensor: torch.Tensor, key: int | None = None):
        """Export ``tensor`` under ``key`` (an `AutoEngine` passes its staged registration's key,
        so every route names the pool alike) or a new one; its `Registration`."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            raise TransferError("cuda_ipc registers CUDA tensors only")
        from kvtransfer.verbs.gpu import allocation_range

        base, _ = allocation_range(tensor)
        handle = bytes(self._cp.cuda.runtime.ipcGetMemHandle(base))
        export = IpcExport(0, handle, tensor.data_ptr() - base, tensor.numel() * tensor.element_size(),
                           tensor.device.index or 0)   # its key: the registration's (`_serve_connection`)
        if copy_kernel.available(tensor.device):   # build the copy kernel now, not in the first write
            with torch.cuda.device(tensor.device):
                scratch = torch.zeros(64, dtype=torch.uint8, device=tensor.device)
                copy_kernel.copy_ranges(scratch, scratch, [(0, 32, 8), (16, 48, 8)])
        return self._exports.register_device(tensor, export, key)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._exports.deregister(region.key)

    def describe(self) -> EndpointInfo:
        return EndpointInfo(self._s.endpoint_id, local_host_id(), self._exports.regions(), (self._transport(),))

    def _local_table(self) -> MemoryTable:
        return self._exports

    # -- receiver -------------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> InboundConnection:
        table = self._exports
        send = lambda s: s.sendall(encode_exports(  # noqa: E731
            [dataclasses.replace(r.shared, key=r.region.key) for r in table.registrations()]))
        return _IpcInbound(self._s, sock, after_auth=send, table=table)

    # -- writer ---------------------------------------------------------------------------------
    def _open_peer(self, info: EndpointInfo, tag: str) -> list[OutboundStream]:
        if not self.reachable(info):
            raise TransferError(f"peer {info.endpoint_id} is not reachable over cuda_ipc from this host")
        addr = info.transport(TransportKind.CUDA_IPC)
        sock, exports = self._connect_unix(addr.path, _recv_table)
        try:
            remote = self._open_exports(info.endpoint_id, exports)
        except BaseException:
            sock.close()
            raise
        sender = _IpcSender(self._cp.cuda.runtime, self._exports, remote)
        return [OutboundStream(sock, f"kv-ipc-{tag}", self._s, tag, self._threads, sender.send, sender.flush)]

    def _open_exports(self, endpoint_id: str, exports: list[IpcExport]) -> dict[int, torch.Tensor]:
        runtime = self._cp.cuda.runtime
        bases: dict[bytes, int] = {}
        remote = {}
        try:
            for e in exports:
                if e.handle not in bases:
                    with self._cp.cuda.Device(e.device):
                        bases[e.handle] = int(runtime.ipcOpenMemHandle(e.handle, IPC_LAZY_PEER_ACCESS))
                remote[e.key] = self._device_bytes(bases[e.handle] + e.offset, e.length, e.device)
        except self._cp.cuda.runtime.CUDARuntimeError as exc:
            for base in bases.values():
                runtime.ipcCloseMemHandle(base)
            raise TransferError(f"cannot open the peer's CUDA IPC handles: {exc}") from exc
        self._opened[endpoint_id] = list(bases.values())
        self._remote[endpoint_id] = remote
        self._lengths[endpoint_id] = {key: t.numel() for key, t in remote.items()}
        return remote

    def _device_bytes(self, addr: int, length: int, device: int) -> torch.Tensor:
        """A uint8 torch tensor over ``length`` bytes of device memory at ``addr`` (an opened peer
        allocation: it lives until `disconnect` closes its handle)."""
        cp = self._cp
        mem = cp.cuda.UnownedMemory(addr, length, self, device_id=device)
        array = cp.ndarray((length,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(array, device=f"cuda:{device}")

    def _check_remote(self, peer: OutboundPeer, ops: Sequence[WriteOp]) -> RemoteAccessError | None:
        return check_remote_ranges(ops, self._lengths.get(peer.info.endpoint_id, {}))

    def disconnect(self, peer) -> None:  # type: ignore[override]
        with self._lock:
            state = self._peers.get(peer)
        super().disconnect(peer)
        if state is not None:
            self._remote.pop(state.info.endpoint_id, None)
            self._lengths.pop(state.info.endpoint_id, None)
            for base in self._opened.pop(state.info.endpoint_id, []):
                self._cp.cuda.runtime.ipcCloseMemHandle(base)


class _IpcSender:
    """One stream thread's writes to one peer (module doc): ``send`` launches a group's copies on
    the thread's own CUDA stream and records an event after them; a group's NOTIFY frames go out,
    in order, once its event has completed: checked after each launch, waited for when more than
    `IN_FLIGHT` groups are pending, and by ``flush`` for all of them. Used by the stream's tx thread
    alone."""

    def __init__(self, runtime, exports: MemoryTable, remote: dict[int, torch.Tensor]) -> None:
        self._runtime, self._exports, self._remote = runtime, exports, remote
        self._stream: torch.cuda.Stream | None = None
        self._pending: deque[tuple[torch.cuda.Event, bytes]] = deque()

    def send(self, sock: socket.socket, batches: list[tuple[Sequence[WriteOp], int]]) -> None:
        """Launch the copies of ``batches`` (`OutboundStream`'s batch parts), defer their NOTIFY."""
        stream = None
        parts: dict[tuple[int, int], list[np.ndarray]] = {}
        for ops, _ in batches:   # each part on its own: a `WriteOps` part is planned from its arrays
            for pair, ranges in copy_plan(ops).items():
                parts.setdefault(pair, []).append(ranges)
        for (local_key, remote_key), pieces in parts.items():
            ranges = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
            src, dst = home_bytes(self._exports.get(local_key).owner), self._remote[remote_key]
            stream = self._stream = self._stream or torch.cuda.Stream(device=src.device)
            with torch.cuda.device(src.device), torch.cuda.stream(stream):
                if len(ranges) > 1 and copy_kernel.available(src.device):
                    copy_kernel.copy_ranges(dst, src, ranges)
                else:
                    for d, s, n in ranges.tolist():
                        self._runtime.memcpyAsync(dst.data_ptr() + d, src.data_ptr() + s, n,
                                                  self._runtime.memcpyDeviceToDevice, stream.cuda_stream)
        event = torch.cuda.Event()
        if stream is not None:
            event.record(stream)
        self._pending.append((event, b"".join(frame for frame, _ in group_frames(T_NOTIFY, batches, with_ops=False))))
        while self._pending and (len(self._pending) > IN_FLIGHT or self._pending[0][0].query()):
            event, frames = self._pending[0]
            event.synchronize()   # the bytes are in the peer's pool before its immediates are sent
            self._pending.popleft()
            sock.sendall(frames)

    def flush(self, sock: socket.socket) -> None:
        """Wait for every pending group's copies and send its NOTIFY frames, in order; returns with
        none pending (and no copy in flight) even when a send raises ``OSError``."""
        try:
            while self._pending:
                event, frames = self._pending[0]
                event.synchronize()
                self._pending.popleft()
                sock.sendall(frames)
        finally:
            while self._pending:
                self._pending.popleft()[0].synchronize()


def _recv_table(sock: socket.socket) -> list[IpcExport]:
    head = memoryview(bytearray(_LEN.size))
    if not recv_exact(sock, head):
        raise TransferError("cuda_ipc peer sent no export table")
    (length,) = _LEN.unpack(head)
    if length > _MAX_TABLE:
        raise TransferError(f"cuda_ipc export table of {length} bytes")
    body = memoryview(bytearray(length))
    if not recv_exact(sock, body):
        raise TransferError("cuda_ipc peer closed during its export table")
    return decode_exports(bytes(body))


class _IpcInbound(InboundConnection):
    """The cuda_ipc receiver: NOTIFY frames carry no payload (the writer's copies already put the
    bytes in the exported allocation, and completed), so nothing is left to place."""

    frame_type = T_NOTIFY
    need_shared = True

    def _place(self, checked: CheckedDescs) -> None:
        pass
