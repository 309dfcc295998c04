"""``shm``: the same-host fast path (the CUDA-IPC / NVLink analogue on CPU).

The receiver builds its KV pool on :func:`allocate_shared_buffer` (an anonymous ``memfd``) and
registers it with ``register_memory(pool, shared=handle)``. A writer on the same host connects to
the receiver's abstract Unix socket, authenticates with the shared secret (the same handshake as
tcp), and only then receives the memfd over ``SCM_RIGHTS`` and maps it. No file name ever exists,
so an unauthenticated process cannot map the pool.

A write is one memcpy from the writer's pool into the mapping; after the copies of a batch the
writer sends a NOTIFY frame with the batch's write descriptors (key, offset, length, immediate)
over the Unix socket; the receiver re-checks them, delivers the immediates and acks the batch. Keys and bounds are checked
by the writer before any byte is copied (a bad batch fails as a whole with ``RemoteAccessError``,
nothing written): with shared memory the writer's library is the only place that can check, as
the NIC is for verbs.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.base import ArrivalHandler, WriteOp, merged_ranges, write_arrays
from kvtransfer.config import EngineConfig
from kvtransfer.connection import InboundConnection, OutboundStream, Shared
from kvtransfer.endpoint import EndpointInfo, TransportAddress, TransportKind, local_host_id
from kvtransfer.errors import RemoteAccessError, TransferError
from kvtransfer.frame import T_NOTIFY, CheckedDescs, group_frames, recv_exact
from kvtransfer.memory import ViewCache
from kvtransfer.software import OutboundPeer, SoftwareEngine, check_remote_ranges

_LEN = struct.Struct("!I")
_MAX_FDS = 64


class SharedBuffer:
    """An anonymous shared-memory buffer (``memfd``) and its mapping in this process.

    ``close()`` closes the fd; the mapping lives while tensors viewing it do.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.nbytes = nbytes
        self.mmap = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def allocate_shared_buffer(nbytes: int) -> tuple[torch.Tensor, SharedBuffer]:
    """A zero-filled ``torch.uint8`` tensor of ``nbytes`` in shared memory, and its handle.

    View it as the pool (``t.view(dtype).view(shape)``) and register that view with
    ``shared=handle``. The caller keeps the handle until the engine is closed.
    """
    buf = SharedBuffer(nbytes)
    return buf.tensor, buf


@dataclass(frozen=True, slots=True)
class _Export:
    key: int
    buffer: int
    offset: int
    length: int


def _send_exports(sock: socket.socket, regs: Sequence) -> None:
    fds: list[int] = []
    exports = []
    for reg in regs:
        buf = reg.shared
        if not isinstance(buf, SharedBuffer) or buf.fd < 0:
            continue
        if buf.fd not in fds:
            fds.append(buf.fd)
        exports.append([reg.region.key, fds.index(buf.fd), reg.region.addr - buf.base, reg.region.length])
    body = json.dumps(exports).encode()
    socket.send_fds(sock, [_LEN.pack(len(body)) + body], fds[:_MAX_FDS])


def _recv_exports(sock: socket.socket) -> tuple[list[_Export], list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
    if len(data) < _LEN.size:
        raise TransferError("shm peer sent no region table")
    (length,) = _LEN.unpack(data[:_LEN.size])
    body = bytearray(data[_LEN.size:])
    if len(body) < length:
        rest = memoryview(bytearray(length - len(body)))
        if not recv_exact(sock, rest):
            raise TransferError("shm peer closed during the region table")
        body += rest
    return [_Export(*e) for e in json.loads(body)], list(fds)


def _map_exports(exports: list[_Export], fds: list[int]) -> dict[int, memoryview]:
    maps = []
    try:
        for fd in fds:
            size = os.fstat(fd).st_size
            maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
    finally:
        for fd in fds:
            os.close(fd)
    views = {}
    for e in exports:
        views[e.key] = memoryview(maps[e.buffer])[e.offset:e.offset + e.length]
    return views


class ShmEngine(SoftwareEngine):
    """The shm engine; see the module docstring. Listens from construction until ``close()``."""

    name = "shm"
    MIRROR_ALLOCATOR = staticmethod(allocate_shared_buffer)

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        super().__init__(config, arrivals, shared)
        self._path = f"@pdserve-kv-{self._s.endpoint_id}"
        self._views: dict[str, dict[int, memoryview]] = {}
        self._lengths: dict[str, dict[int, int]] = {}   # peer endpoint id -> its regions' bytes
        self._listen_unix(self._path)

    def _transport(self) -> TransportAddress:
        return TransportAddress(TransportKind.SHM, path=self._path)

    @staticmethod
    def reachable(info: EndpointInfo) -> bool:
        """True when ``info`` offers shm and runs on this host."""
        return info.transport(TransportKind.SHM) is not None and info.host_id == local_host_id()

    # -- receiver -----------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> InboundConnection:
        memory = self._s.memory
        return _ShmInbound(self._s, sock, after_auth=lambda s: _send_exports(s, memory.registrations()))

    # -- writer -------------------------------------------------------------------------------
    def _open_peer(self, info: EndpointInfo, tag: str) -> list[OutboundStream]:
        if not self.reachable(info):
            raise TransferError(f"peer {info.endpoint_id} is not reachable over shm from this host")
        addr = info.transport(TransportKind.SHM)
        assert addr is not None
        sock, views = self._connect_unix(addr.path, lambda s: _map_exports(*_recv_exports(s)))
        self._views[info.endpoint_id] = views
        self._lengths[info.endpoint_id] = {key: len(view) for key, view in views.items()}
        send = lambda s, batches: self._send_batches(views, s, batches)  # noqa: E731
        return [OutboundStream(sock, f"kv-shm-{tag}", self._s, tag, self._threads, send)]

    def exported_keys(self, info: EndpointInfo) -> set[int]:
        """Keys of ``info``'s regions this engine mapped (after ``connect``)."""
        return set(self._views.get(info.endpoint_id, {}))

    def _check_remote(self, peer: OutboundPeer, ops: Sequence[WriteOp]) -> RemoteAccessError | None:
        return check_remote_ranges(ops, self._lengths.get(peer.info.endpoint_id, {}))

    def _send_batches(self, views: dict[int, memoryview], sock: socket.socket,
                      batches: list[tuple[Sequence[WriteOp], int]]) -> None:
        if self._s.memory.has_staged:   # device pools: their sources to the mirror first
            self.stager().stage_out([op for ops, _ in batches for op in ops])
        local = ViewCache(self._s.memory)
        key = remote_key = None
        for ops, _ in batches:   # ranges were checked at post; keys are looked up once per run
            if (arrays := write_arrays(ops)) is not None:   # one copy per run contiguous on both sides
                src, dst = local.view(ops.local.key), views[ops.remote_key]
                for ro, lo, n in merged_ranges(arrays).tolist():
                    dst[ro:ro + n] = src[lo:lo + n]
                key = remote_key = None   # src and dst are this batch's now
                continue
            for op in ops:
                if op.local.key != key:
                    key = op.local.key
                    src = local.view(key)
                if op.remote_key != remote_key:
                    remote_key = op.remote_key
                    dst = views[remote_key]
                ro, lo, n = op.remote_offset, op.local_offset, op.length
                dst[ro:ro + n] = src[lo:lo + n]
        sock.sendall(b"".join(frame for frame, _ in group_frames(T_NOTIFY, batches, with_ops=False)))

    def disconnect(self, peer) -> None:  # type: ignore[override]
        with self._lock:
            state = self._peers.get(peer)
        super().disconnect(peer)
        if state is not None:
            self._views.pop(state.info.endpoint_id, None)
            self._lengths.pop(state.info.endpoint_id, None)


class _ShmInbound(InboundConnection):
    """The shm receiver: NOTIFY frames carry no payload (the writer already copied the bytes into
    the shared mapping), so only shared regions are valid targets and nothing is left to place."""

    frame_type = T_NOTIFY
    need_shared = True

    def _place(self, checked: CheckedDescs) -> None:
        pass
