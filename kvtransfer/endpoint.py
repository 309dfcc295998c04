"""What a peer needs to connect to this engine, as versioned bytes the control plane carries.

An :class:`EndpointInfo` is produced by ``engine.describe()`` on the receiver (decode), handed to the
writer (prefill) by the router, and consumed by ``engine.connect()``. It is opaque to the router:
carry ``to_bytes()`` verbatim (a protobuf ``bytes`` field).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from enum import Enum
from typing import NewType

from kvtransfer.errors import TransferError

EndpointId = NewType("EndpointId", str)

ENDPOINT_VERSION = 1
_MAGIC = "pdserve-kv"


class TransportKind(str, Enum):
    TCP = "tcp"
    SHM = "shm"
    VERBS = "verbs"
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A registered memory range.

    ``addr`` is the virtual address in the owner's process (informational for tcp/shm, the RDMA
    remote address for verbs), ``length`` bytes, ``key`` the 32-bit access key a writer must name
    (the MR's rkey for verbs, a random key for tcp/shm). Offsets in writes are relative to ``addr``.
    """

    addr: int
    length: int
    key: int


@dataclass(frozen=True, slots=True)
class TransportAddress:
    """How to reach one transport of an endpoint: tcp/verbs bootstrap at (host, port); shm at the
    abstract Unix socket ``path``."""

    kind: TransportKind
    host: str = ""
    port: int = 0
    path: str = ""


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """Versioned, serialisable description of an endpoint.

    Fields: ``endpoint_id`` unique per engine instance; ``host_id`` equal for engines on the same
    host (boot id + hostname) so shm is chosen between them; ``regions`` the registered memory;
    ``transports`` the ways in, in preference order.
    """

    endpoint_id: EndpointId
    host_id: str
    regions: tuple[MemoryRegion, ...]
    transports: tuple[TransportAddress, ...]
    version: int = ENDPOINT_VERSION

    def transport(self, kind: TransportKind) -> TransportAddress | None:
        return next((t for t in self.transports if t.kind == kind), None)

    def region(self, key: int) -> MemoryRegion | None:
        return next((r for r in self.regions if r.key == key), None)

    def to_bytes(self) -> bytes:
        doc = {
            "magic": _MAGIC, "version": self.version, "endpoint_id": self.endpoint_id,
            "host_id": self.host_id,
            "regions": [[r.addr, r.length, r.key] for r in self.regions],
            "transports": [[t.kind.value, t.host, t.port, t.path] for t in self.transports],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "EndpointInfo":
        """Parse :meth:`to_bytes` output; ``TransferError`` if malformed or another version."""
        try:
            doc = json.loads(data)
            if doc.get("magic") != _MAGIC:
                raise TransferError("not a pdserve kvtransfer endpoint description")
            if doc["version"] != ENDPOINT_VERSION:
                raise TransferError(f"endpoint version {doc['version']}, this build speaks {ENDPOINT_VERSION}")
            return cls(
                endpoint_id=EndpointId(str(doc["endpoint_id"])), host_id=str(doc["host_id"]),
                regions=tuple(MemoryRegion(int(a), int(n), int(k)) for a, n, k in doc["regions"]),
                transports=tuple(TransportAddress(TransportKind(k), str(h), int(p), str(path))
                                 for k, h, p, path in doc["transports"]),
            )
        except TransferError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"malformed endpoint description: {exc}") from exc


def local_host_id() -> str:
    """Boot id + hostname: equal for processes sharing a kernel and a UTS namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{boot}/{socket.gethostname()}"
