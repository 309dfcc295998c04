"""Settings of the RDMA lab: one frozen dataclass, validated when built.

Environment variables are read here only: :func:`LabConfig.from_env` (``PDSERVE_LAB_ACCEL``,
``PDSERVE_LAB_MEMORY_MIB``, ``PDSERVE_LAB_CACHE``), :func:`in_lab` / :func:`guest_outbox`
(``PDSERVE_LAB``, ``RDMALAB_OUTBOX``, set by the guest's init) and :func:`run_timeout_s`
(``PDSERVE_LAB_TIMEOUT_S``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ACCELS = ("tcg", "kvm")


@dataclass(frozen=True, slots=True)
class LabConfig:
    """How to build and boot the guest.

    Fields:
        cache_dir: where the kernel, its modules and the initramfs are kept (git-ignored).
        memory_mib: guest memory in MiB (the cluster test runs three torch processes).
        cpus: guest vCPUs (TCG runs one host thread per vCPU).
        accel: "tcg" (emulation: works wherever qemu runs; the default) or "kvm". Not probed
            automatically: a /dev/kvm that opens and even creates a VM can still hang the guest
            (seen on a nested host without VMX).
        boot_timeout_s: seconds from qemu's start until the guest's init reports the network
            and the rxe devices are up; past it the guest is killed.
        workdir: host directory that is the command's working directory in the guest (the host
            root is the guest's root, read-only, so the path is the same).
        kernel_package: Debian package of the guest kernel (its 6.1 build has CONFIG_RDMA_RXE=m).
        cpu: the guest CPU model under TCG (``-cpu``). Without AVX: torch and oneDNN then run
            SSE code, which TCG translates far faster than its helper-based AVX2 emulation.
    """

    cache_dir: Path = field(default_factory=lambda: REPO_ROOT / ".rdmalab")
    memory_mib: int = 8192
    cpus: int = 2
    accel: str = "tcg"
    boot_timeout_s: float = 180.0
    workdir: Path = REPO_ROOT
    kernel_package: str = "linux-image-amd64"
    cpu: str = "Nehalem"

    def __post_init__(self) -> None:
        if self.accel not in ACCELS:
            raise ValueError(f"LabConfig.accel must be one of {ACCELS}, got {self.accel!r}")
        if self.memory_mib < 1024:
            raise ValueError(f"LabConfig.memory_mib must be >= 1024, got {self.memory_mib}")
        if not 1 <= self.cpus <= 64:
            raise ValueError(f"LabConfig.cpus must be in [1, 64], got {self.cpus}")
        if self.boot_timeout_s <= 0:
            raise ValueError("LabConfig.boot_timeout_s must be positive")

    @classmethod
    def from_env(cls, **overrides: object) -> "LabConfig":
        """Defaults, then ``PDSERVE_LAB_*`` variables, then ``overrides``."""
        env: dict[str, object] = {}
        if os.environ.get("PDSERVE_LAB_ACCEL"):
            env["accel"] = os.environ["PDSERVE_LAB_ACCEL"]
        if os.environ.get("PDSERVE_LAB_MEMORY_MIB"):
            env["memory_mib"] = int(os.environ["PDSERVE_LAB_MEMORY_MIB"])
        if os.environ.get("PDSERVE_LAB_CPU"):
            env["cpu"] = os.environ["PDSERVE_LAB_CPU"]
        if os.environ.get("PDSERVE_LAB_CACHE"):
            env["cache_dir"] = Path(os.environ["PDSERVE_LAB_CACHE"])
        return replace(cls(), **{**env, **overrides})


def in_lab() -> bool:
    """True inside the lab's guest (its init exports ``PDSERVE_LAB=1``)."""
    return os.environ.get("PDSERVE_LAB") == "1"


def guest_outbox() -> Path | None:
    """Inside the guest: the directory shared with the host (``$RDMALAB_OUTBOX``); else None."""
    value = os.environ.get("RDMALAB_OUTBOX")
    return Path(value) if in_lab() and value else None


def run_timeout_s() -> float:
    """Seconds a whole lab run may take (``PDSERVE_LAB_TIMEOUT_S``, default 2700: pytest runs the lab
    beside the host's tests, which slow its emulated CPU)."""
    return float(os.environ.get("PDSERVE_LAB_TIMEOUT_S", "2700"))
