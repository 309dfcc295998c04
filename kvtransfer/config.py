"""Configuration of the transfer engines: one frozen dataclass, validated when built.

Environment variables are not read here; the worker's config loader maps its flags onto these
fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_IB_MTUS = (256, 512, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class VerbsConfig:
    """RDMA (pyverbs) settings.

    Fields:
        device: RDMA device name (e.g. ``"mlx5_0"``); empty = first device found.
        port: HCA port number (1-based).
        gid_index: GID table index (RoCE v2 usually 1 or 3; 0 for InfiniBand).
        mtu: path MTU in bytes, one of 256/512/1024/2048/4096.
        qps_per_peer: RC queue pairs per peer (writes are striped across them).
        send_queue_depth: max outstanding send WRs per QP.
        srq_depth: receive WQEs kept posted in the shared receive queue.
        cq_depth: completion queue entries.
        timeout: local ACK timeout exponent (4.096 us * 2**timeout).
        retry_count / rnr_retry: RC retry counts (7 = infinite for rnr_retry).
    """

    device: str = ""
    port: int = 1
    gid_index: int = 0
    mtu: int = 4096
    qps_per_peer: int = 1
    send_queue_depth: int = 1024
    srq_depth: int = 4096
    cq_depth: int = 8192
    timeout: int = 14
    retry_count: int = 7
    rnr_retry: int = 7

    def __post_init__(self) -> None:
        if self.mtu not in _IB_MTUS:
            raise ValueError(f"VerbsConfig.mtu must be one of {_IB_MTUS}, got {self.mtu}")
        if self.port < 1 or self.gid_index < 0 or self.qps_per_peer < 1:
            raise ValueError("VerbsConfig: port >= 1, gid_index >= 0, qps_per_peer >= 1")
        if min(self.send_queue_depth, self.srq_depth, self.cq_depth) < 1:
            raise ValueError("VerbsConfig: queue depths must be positive")
        if self.cq_depth < self.srq_depth:
            raise ValueError("VerbsConfig.cq_depth must be >= srq_depth (every receive completes on the CQ)")
        if not 0 <= self.timeout <= 31 or not 0 <= self.retry_count <= 7 or not 0 <= self.rnr_retry <= 7:
            raise ValueError("VerbsConfig: timeout in [0, 31], retry_count and rnr_retry in [0, 7]")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings shared by every engine (tcp and shm use all of them, verbs the auth and timeouts).

    Fields:
        secret: shared secret authenticating peers (HMAC-SHA256 challenge-response), >= 16 bytes.
        bind_host: address the tcp listener binds.
        advertise_host: address put in :class:`EndpointInfo` for peers; empty = ``bind_host``.
        port: tcp listener port; 0 = ephemeral.
        streams_per_peer: tcp connections per peer; writes are spread over them by bytes.
        socket_buffer_bytes: ``SO_SNDBUF`` / ``SO_RCVBUF`` requested (the kernel may cap it).
        connect_timeout_s: deadline for connecting + handshaking with a peer (seconds).
        close_timeout_s: how long ``close()`` waits for each thread to stop (seconds).
        enable_shm: offer/accept the shared-memory path (``auto`` engine) for same-host peers.
        verbs: RDMA settings, used only by the ``verbs`` engine.
    """

    secret: bytes
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""
    port: int = 0
    streams_per_peer: int = 2
    socket_buffer_bytes: int = 8 << 20
    connect_timeout_s: float = 10.0
    close_timeout_s: float = 5.0
    enable_shm: bool = True
    verbs: VerbsConfig = field(default_factory=VerbsConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("EngineConfig.secret must be bytes of length >= 16")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"EngineConfig.port must be in [0, 65535], got {self.port}")
        if not 1 <= self.streams_per_peer <= 64:
            raise ValueError(f"EngineConfig.streams_per_peer must be in [1, 64], got {self.streams_per_peer}")
        if self.socket_buffer_bytes < 4096:
            raise ValueError("EngineConfig.socket_buffer_bytes must be >= 4096")
        if self.connect_timeout_s <= 0 or self.close_timeout_s <= 0:
            raise ValueError("EngineConfig timeouts must be positive")

    @property
    def host_for_peers(self) -> str:
        return self.advertise_host or self.bind_host
