"""The guest's initramfs: static busybox, the init script, the kernel modules and their load
order, written as a ``newc`` cpio archive (the format the kernel unpacks into its rootfs; see
the kernel's Documentation/driver-api/early-userspace/buffer-format.rst)."""

from __future__ import annotations

import hashlib
import shutil
import stat
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from rdmalab import network
from rdmalab.errors import LabUnavailable
from rdmalab.kernel import read_module

_TRAILER = "TRAILER!!!"


class CpioWriter:
    """Append-only ``newc`` archive: directories, files, device nodes, then :meth:`close` (trailer)."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "wb")
        self._ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self._ino += 1
        self._file.write(header + encoded)
        self._file.write(b"\0" * (-(len(header) + len(encoded)) % 4))
        self._file.write(data)
        self._file.write(b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def char_device(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def close(self) -> None:
        self._entry(_TRAILER, 0)
        self._file.close()


def init_script() -> bytes:
    """The guest's ``/init`` (package data ``rdmalab/init.sh``)."""
    return resources.files("rdmalab").joinpath("init.sh").read_bytes()


def find_busybox() -> Path:
    """A statically linked busybox (Debian ``busybox-static``); ``LabUnavailable`` otherwise."""
    path = shutil.which("busybox")
    if path is None:
        raise LabUnavailable("busybox is not installed (run: python -m rdmalab setup)")
    data = Path(path).read_bytes()[:1 << 16]
    if b"/lib64/ld-linux" in data or b"ld-linux-x86-64" in data:
        raise LabUnavailable(f"{path} is dynamically linked; install busybox-static")
    return Path(path)


def fingerprint(modules: Iterable[Path], busybox: Path) -> str:
    """Identifies an initramfs's inputs: rebuild when the init script, a module or busybox changes."""
    h = hashlib.sha256(init_script() + network.shell_assignments().encode())
    for path in [*modules, busybox]:
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_initramfs(path: Path, modules: list[Path], busybox: Path) -> None:
    """Write the archive to ``path`` (atomically: a partial file never has the final name)."""
    tmp = path.with_suffix(".partial")
    cpio = CpioWriter(tmp)
    for d in ("bin", "sbin", "dev", "proc", "sys", "etc", "etc/rdmalab", "lib", "lib/modules", "newroot",
              "outbox"):
        cpio.directory(d)
    cpio.char_device("dev/console", 5, 1)   # init's stdio before devtmpfs is mounted
    cpio.file("bin/busybox", busybox.read_bytes(), 0o755)
    cpio.file("init", init_script(), 0o755)
    names = []
    for module in modules:
        name = module.name.split(".ko")[0]
        names.append(name)
        cpio.file(f"lib/modules/{name}.ko", read_module(module))
    cpio.file("etc/rdmalab/modules", "".join(f"{n}\n" for n in names).encode())
    cpio.file("etc/rdmalab/network", network.shell_assignments().encode())
    cpio.close()
    tmp.replace(path)
