"""What the lab needs on the host: Debian packages (``setup``), then the kernel, its modules and
the initramfs, built once into the cache directory (``prepare``).

``setup`` installs with apt-get (root): qemu to boot the guest; rdma-core, ibverbs-providers
(librxe), ibverbs-utils, iproute2 (``rdma``) and python3-pyverbs, which the guest uses from the
host's root filesystem (shared read-only); busybox-static for the initramfs. The kernel is
Debian's ``linux-image-amd64`` (see :mod:`rdmalab.kernel`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rdmalab.config import LabConfig
from rdmalab.errors import LabUnavailable
from rdmalab.initramfs import build_initramfs, find_busybox, fingerprint
from rdmalab.kernel import fetch_kernel, load_order

DEBIAN_PACKAGES = ("qemu-system-x86", "rdma-core", "ibverbs-providers", "ibverbs-utils", "iproute2",
                   "python3-pyverbs", "busybox-static")
# Host files the guest runs (from the shared root) or qemu needs; checked before a boot.
REQUIRED_FILES = {
    "qemu-system-x86_64": "qemu-system-x86",
    "/usr/sbin/ip": "iproute2",
    "/usr/bin/rdma": "iproute2",
    "/usr/lib/python3/dist-packages/pyverbs/__init__.py": "python3-pyverbs",
}


@dataclass(frozen=True, slots=True)
class Assets:
    """A bootable lab: kernel image, initramfs, and the kernel version they belong to."""

    kernel: Path
    initramfs: Path
    kernel_version: str


def install_packages(packages: tuple[str, ...] = DEBIAN_PACKAGES) -> None:
    """``apt-get update`` + ``apt-get install --no-install-recommends`` (root only).

    Raises ``LabUnavailable`` when not root, without apt, or when apt fails (its stderr tail).
    """
    if os.geteuid() != 0:
        raise LabUnavailable("installing the lab's Debian packages needs root")
    if shutil.which("apt-get") is None:
        raise LabUnavailable("apt-get is not available: install " + " ".join(packages) + " by hand")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]):
        res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
        if res.returncode != 0:
            raise LabUnavailable(f"{' '.join(argv[:2])} failed: {res.stderr.strip()[-2000:]}")


def missing() -> list[str]:
    """What is missing on this host to boot the lab, as ``"<file> (package)"``; empty when ready."""
    gaps = []
    for path, package in REQUIRED_FILES.items():
        found = shutil.which(path) if "/" not in path else (path if Path(path).exists() else None)
        if found is None:
            gaps.append(f"{path} ({package})")
    try:
        find_busybox()
    except LabUnavailable:
        gaps.append("static busybox (busybox-static)")
    return gaps


def prepare(config: LabConfig) -> Assets:
    """Build (or reuse from ``config.cache_dir``) the kernel and the initramfs.

    Raises ``LabUnavailable`` with what to install when something is missing.
    """
    gaps = missing()
    if gaps:
        raise LabUnavailable(f"missing: {', '.join(gaps)} (run: python -m rdmalab setup)")
    kernel = fetch_kernel(config.cache_dir, config.kernel_package)
    modules = load_order(kernel.modules)
    busybox = find_busybox()
    initramfs = config.cache_dir / f"initramfs-{kernel.version}-{fingerprint(modules, busybox)}.cpio"
    if not initramfs.exists():
        for stale in config.cache_dir.glob("initramfs-*.cpio"):
            stale.unlink()
        build_initramfs(initramfs, modules, busybox)
    return Assets(kernel.vmlinuz, initramfs, kernel.version)
