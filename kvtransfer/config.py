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
        device: RDMA device name (e.g. ``"mlx5_0"``, ``"rxe0"``); empty = first device found.
        port: HCA port number (1-based); must be ACTIVE.
        gid_index: GID table index; -1 = choose (RoCE v2 with an IPv4-mapped address first, as
            Mooncake and NCCL do; 0 on InfiniBand). Index 0 on RoCE is usually link-local.
        mtu: largest path MTU in bytes, one of 256/512/1024/2048/4096; the engine uses the
            smallest of this, the port's ``active_mtu`` and the peer's.
        qps_per_peer: RC queue pairs per peer (writes are striped across them).
        send_queue_depth: max outstanding send WRs per QP. Keep ``peers x this`` at or below
            the receivers' ``srq_depth`` and writers never meet an empty SRQ (RNR).
        srq_depth: receive WQEs kept posted in the shared receive queue.
        cq_depth: completion queue entries; the engine keeps at most
            ``cq_depth - srq_depth - 64`` sends outstanding (64 left for drain markers), so the
            CQ shared by the SRQ and every send queue cannot overrun.
        timeout: local ACK timeout exponent (4.096 us * 2**timeout; 14 = 67 ms).
        retry_count: transport retries before RETRY_EXC_ERR (0..7).
        rnr_retry: RNR NAK retries before RNR_RETRY_EXC_ERR, 0..6 (7 would retry forever).
        min_rnr_timer: RNR NAK timer code sent to writers (IB spec table 45; 24 = 40.96 ms).
        cq_mode: "event" (select on the completion channel's fd; no wake-ups while idle) or
            "poll" (poll the CQ with a 0.1-10 ms backoff).
    """

    device: str = ""
    port: int = 1
    gid_index: int = -1
    mtu: int = 4096
    qps_per_peer: int = 1
    send_queue_depth: int = 512
    srq_depth: int = 4096
    cq_depth: int = 8192
    timeout: int = 14
    retry_count: int = 7
    rnr_retry: int = 6
    min_rnr_timer: int = 24
    cq_mode: str = "event"

    def __post_init__(self) -> None:
        if self.mtu not in _IB_MTUS:
            raise ValueError(f"VerbsConfig.mtu must be one of {_IB_MTUS}, got {self.mtu}")
        if self.port < 1 or self.gid_index < -1 or not 1 <= self.qps_per_peer <= 16:
            raise ValueError("VerbsConfig: port >= 1, gid_index >= -1 (-1: choose), qps_per_peer in [1, 16]")
        if min(self.send_queue_depth, self.srq_depth, self.cq_depth) < 1:
            raise ValueError("VerbsConfig: queue depths must be positive")
        if self.cq_depth < self.srq_depth + 64 + 16:
            raise ValueError("VerbsConfig.cq_depth must exceed srq_depth + 80 (receives, drain markers "
                             "and some sends all complete on the one CQ)")
        if not 0 <= self.timeout <= 31 or not 0 <= self.retry_count <= 7 or not 0 <= self.rnr_retry <= 6:
            raise ValueError("VerbsConfig: timeout in [0, 31], retry_count in [0, 7], rnr_retry in [0, 6] "
                             "(7 = retry forever, never used)")
        if not 0 <= self.min_rnr_timer <= 31:
            raise ValueError("VerbsConfig.min_rnr_timer must be in [0, 31]")
        if self.cq_mode not in ("event", "poll"):
            raise ValueError(f"VerbsConfig.cq_mode must be 'event' or 'poll', got {self.cq_mode!r}")

    @property
    def send_budget(self) -> int:
        """Sends that may be outstanding at once on this engine's CQ."""
        return self.cq_depth - self.srq_depth - 64


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
