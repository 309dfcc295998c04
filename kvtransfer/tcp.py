"""``tcp``: one-sided writes with immediates over TCP, for hosts without RDMA.

Wire: up to 256 writes travel as one :mod:`kvtransfer.frame` WRITE frame: header, descriptors
(key, immediate, offset, length), payloads, sent with one ``sendmsg`` whose iovecs point at the
registered source memory. The receiver checks every descriptor's key and bounds against its
:class:`~kvtransfer.memory.MemoryTable`, then reads all payloads with scatter ``recvmsg_into``
(``MSG_WAITALL``) straight into memoryview slices of the registered buffer (no intermediate copy);
only then are the immediates delivered. A rejected write's payload is read into a scratch buffer
and dropped, so nothing of it is applied; the rejection is counted and reported in the batch's ACK.

Each peer gets ``streams_per_peer`` authenticated connections; a batch is dealt over them by bytes.
A writer that dies closes its sockets (the kernel resets them), so the receiver's blocked
``recv_into`` returns and ``arrivals.on_peer_lost`` fires at once; a silent host failure is
caught by the slot deadline of the completion counter.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvtransfer import auth
from kvtransfer.base import ArrivalHandler, WriteOp, write_arrays
from kvtransfer.config import EngineConfig
from kvtransfer.connection import InboundConnection, OutboundStream, Shared
from kvtransfer.endpoint import EndpointInfo, TransportAddress, TransportKind
from kvtransfer.errors import AuthError, RemoteAccessError, TransferError
from kvtransfer.frame import MAX_DESCS, T_WRITE, CheckedDescs, group_frames, recv_exact_many, send_parts
from kvtransfer.memory import ViewCache
from kvtransfer.software import SoftwareEngine

_SCRATCH_BYTES = 1 << 20


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """Large kernel buffers and no Nagle delay (acks and small frames go out at once)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        except OSError:
            pass


class TcpEngine(SoftwareEngine):
    """The tcp engine; see the module docstring. Listens from construction until ``close()``."""

    name = "tcp"

    def __init__(self, config: EngineConfig, arrivals: ArrivalHandler | None = None,
                 shared: Shared | None = None) -> None:
        super().__init__(config, arrivals, shared)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune_socket(sock, config.socket_buffer_bytes)
        try:
            sock.bind((config.bind_host, config.port))
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot listen on {config.bind_host}:{config.port}: {exc}") from exc
        sock.listen(128)
        self._port = sock.getsockname()[1]
        self._start_listener(sock)

    def _transport(self) -> TransportAddress:
        return TransportAddress(TransportKind.TCP, host=self._s.config.host_for_peers, port=self._port)

    # -- receiver -----------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> InboundConnection:
        tune_socket(sock, self._s.config.socket_buffer_bytes)
        return _TcpInbound(self._s, sock)

    # -- writer -------------------------------------------------------------------------------
    def _open_peer(self, info: EndpointInfo, tag: str) -> list[OutboundStream]:
        addr = info.transport(TransportKind.TCP)
        if addr is None:
            raise TransferError(f"peer {info.endpoint_id} offers no tcp transport")
        streams: list[OutboundStream] = []
        try:
            for i in range(self._s.config.streams_per_peer):
                sock = self._dial(addr)
                streams.append(OutboundStream(sock, f"kv-tcp-{tag}-{i}", self._s, tag, self._threads,
                                              self._send_batches))
        except (TransferError, OSError) as exc:
            for stream in streams:
                stream.close(self._s.config.close_timeout_s)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"cannot connect to {addr.host}:{addr.port}: {exc}") from exc
        return streams

    def _dial(self, addr: TransportAddress) -> socket.socket:
        cfg = self._s.config
        sock = socket.create_connection((addr.host, addr.port), timeout=cfg.connect_timeout_s)
        try:
            tune_socket(sock, cfg.socket_buffer_bytes)
            auth.client_handshake(sock, cfg.secret, self._s.endpoint_id)
            sock.settimeout(None)
            return sock
        except (AuthError, OSError):
            sock.close()
            raise

    def _send_batches(self, sock: socket.socket, batches: list[tuple[Sequence[WriteOp], int]]) -> None:
        if self._s.memory.has_staged:   # device pools: their sources to the mirror first
            self.stager().stage_out([op for ops, _ in batches for op in ops])
        local = ViewCache(self._s.memory)
        payloads: list[memoryview] = []   # every write's bytes, in the group's order
        try:
            for ops, _ in batches:
                if (arrays := write_arrays(ops)) is not None:   # cut from the arrays: no op built
                    view, (offsets, _, lengths) = local.view(ops.local.key), arrays
                    if int((offsets + lengths).max()) > len(view):
                        raise TransferError("a local region was deregistered during a write")
                    payloads += [view[o:o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
                else:
                    payloads += [local.slice(op.local.key, op.local_offset, op.length) for op in ops]
        except RemoteAccessError:
            raise TransferError("a local region was deregistered during a write")
        parts: list = []
        for i, (frame, _) in enumerate(group_frames(T_WRITE, batches, with_ops=False)):   # MAX_DESCS per frame
            parts.append(frame)
            parts += payloads[i * MAX_DESCS:(i + 1) * MAX_DESCS]
        send_parts(sock, parts)


class _TcpInbound(InboundConnection):
    """The tcp receiver: all payloads of a WRITE frame are read with scatter ``recvmsg_into``
    straight into the registered buffer, rejected ones into a scratch buffer (dropped);
    the shared loop delivers the immediates after the whole frame is in place."""

    frame_type = T_WRITE

    def __init__(self, shared: Shared, sock: socket.socket) -> None:
        super().__init__(shared, sock)
        self._scratch: memoryview | None = None   # allocated at the first rejected write
        self._views: dict[int, tuple[object, memoryview]] = {}   # key -> (registration, its view)

    def _place(self, checked: CheckedDescs) -> None:
        views = self._views
        for key, reg in checked.regs.items():
            cached = views.get(key)
            if cached is None or cached[0] is not reg:
                views[key] = (reg, memoryview(reg.view))
        keys = checked.descs["key"].tolist()
        offsets, lengths = checked.descs["offset"].tolist(), checked.descs["length"].tolist()
        if not checked.rejected and len(checked.regs) == 1:
            view = views[keys[0]][1]
            targets = [view[o:o + n] for o, n in zip(offsets, lengths)]
        else:
            if self._scratch is None:
                self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
            scratch, targets = self._scratch, []
            for status, key, offset, length in zip(checked.status.tolist(), keys, offsets, lengths):
                if status == 0:
                    targets.append(views[key][1][offset:offset + length])
                else:   # a rejected payload is read into scratch and dropped
                    targets += [scratch[:min(_SCRATCH_BYTES, length - start)]
                                for start in range(0, length, _SCRATCH_BYTES)]
        recv_exact_many(self.sock, targets)
