"""The guest kernel: Debian's ``linux-image`` package, unpacked without its initramfs step, and
the load order of the few modules the guest needs (read from each module's ``.modinfo``).

Debian's 6.1 kernel builds virtio-pci, 9p, veth and rdma_rxe as modules, so the guest's
initramfs carries them and its init loads them with ``insmod`` in the order computed here:
every module after its ``depends=`` (ELF section ``.modinfo``, see the kernel's
``scripts/mod/modpost.c``), ``crc32_generic`` before ``rdma_rxe`` (rxe asks the crypto API for
"crc32" by name at device creation; without it: "failed to init crc32 algorithm err:-2").
"""

from __future__ import annotations

import lzma
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rdmalab.errors import LabUnavailable

# In load order; each is preceded by what it depends on.
ROOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "veth", "crc32_generic", "ib_uverbs", "rdma_rxe")


@dataclass(frozen=True, slots=True)
class KernelFiles:
    """An unpacked kernel: ``version`` (e.g. ``6.1.0-56-amd64``), the ``vmlinuz`` image and the
    ``modules`` directory (``lib/modules/<version>/kernel``)."""

    version: str
    vmlinuz: Path
    modules: Path


def _run(argv: list[str], cwd: Path | None = None) -> str:
    try:
        res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as exc:
        raise LabUnavailable(f"{argv[0]} is not installed (run: python -m rdmalab setup)") from exc
    if res.returncode != 0:
        raise LabUnavailable(f"{' '.join(argv)} failed: {res.stderr.strip()[-2000:]}")
    return res.stdout


def kernel_package_name(meta_package: str) -> str:
    """The versioned package the meta package depends on (``linux-image-6.1.0-56-amd64``)."""
    out = _run(["apt-cache", "depends", meta_package])
    match = re.search(r"Depends:\s*(linux-image-\d\S*)", out)
    if match is None:
        raise LabUnavailable(f"apt-cache knows no kernel behind {meta_package} (run: apt-get update)")
    return match.group(1)


def fetch_kernel(cache_dir: Path, meta_package: str) -> KernelFiles:
    """Download and unpack the kernel package into ``cache_dir`` (once; later calls reuse it).

    ``apt-get download`` + ``dpkg-deb -x``: no postinst, so no initramfs-tools run. Raises
    ``LabUnavailable`` when apt cannot find or fetch it.
    """
    for done in sorted(cache_dir.glob("kernel-*/.complete")):
        return _kernel_files(done.parent)
    package = kernel_package_name(meta_package)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        _run(["apt-get", "download", package], cwd=Path(tmp))
        deb = next(Path(tmp).glob("*.deb"))
        _run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")])
        version = package.removeprefix("linux-image-")
        target = cache_dir / f"kernel-{version}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        shutil.copy2(Path(tmp) / "root" / "boot" / f"vmlinuz-{version}", target / "vmlinuz")
        shutil.copytree(Path(tmp) / "root" / "lib" / "modules" / version / "kernel", target / "modules")
        (target / ".complete").write_text(version + "\n")
    return _kernel_files(target)


def _kernel_files(target: Path) -> KernelFiles:
    version = (target / ".complete").read_text().strip()
    return KernelFiles(version, target / "vmlinuz", target / "modules")


def module_index(modules: Path) -> dict[str, Path]:
    """Module name (``-`` as ``_``) -> its file, for every ``.ko`` / ``.ko.xz`` under ``modules``."""
    index = {}
    for path in modules.rglob("*.ko*"):
        name = path.name.split(".ko")[0].replace("-", "_")
        index[name] = path
    return index


def read_module(path: Path) -> bytes:
    """The ELF bytes of a module file (``.ko`` or xz-compressed ``.ko.xz``)."""
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if not path.name.endswith(".ko"):
        raise LabUnavailable(f"cannot read {path.name}: only .ko and .ko.xz modules are supported")
    return data


def module_depends(elf: bytes) -> list[str]:
    """The ``depends=`` list of a 64-bit little-endian ELF module's ``.modinfo`` section."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        end = elf.index(b"\0", str_off + name)
        if elf[str_off + name:end] == b".modinfo":
            for entry in elf[offset:offset + size].split(b"\0"):
                if entry.startswith(b"depends="):
                    deps = entry[len(b"depends="):].decode()
                    return [d.replace("-", "_") for d in deps.split(",") if d]
            return []
    raise ValueError("no .modinfo section")


def load_order(modules: Path, roots: tuple[str, ...] = ROOT_MODULES) -> list[Path]:
    """Module files to ``insmod`` in order: each root preceded by its dependency closure.

    Raises ``LabUnavailable`` naming a module the kernel does not ship (e.g. a kernel built
    without ``CONFIG_RDMA_RXE=m``); modules built into the kernel are fine (not in the tree,
    nobody depends on them by name).
    """
    index = module_index(modules)
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in seen:
            return
        path = index.get(name)
        if path is None:
            raise LabUnavailable(f"kernel module {name} is missing (needed by {' <- '.join(chain) or 'the lab'})")
        seen.add(name)
        for dep in module_depends(read_module(path)):
            visit(dep, chain + (name,))
        order.append(path)

    for root in roots:
        visit(root, ())
    return order
