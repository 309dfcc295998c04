"""One face over the pyverbs releases pdserve meets: rdma-core v44 (Debian 12), v50 (Ubuntu
24.04), v56 (Debian 13) and v59+ (also the PyPI ``pyverbs``). Every difference is handled here
and nowhere else:

- Enum names. Up to v57 they are module attributes of ``pyverbs.enums`` (``e.IBV_QPS_RTS``);
  v59 removed that module and ``pyverbs.libibverbs_enums`` holds them in enum classes
  (``ibv_qp_state.IBV_QPS_RTS``). :func:`enum` resolves a name in whichever exists.
- ``RecvWR``/``SendWR`` without an SGE: refused by ``RecvWR`` before v57 and by ``SendWR`` in
  every release ("A WR needs at least one SGE", ``pyverbs/wr.pyx``). Callers always pass one SGE.
- The completion channel's fd: the ``CompChannel.fd`` property exists from v59 only; the async
  event fd of a ``Context`` is exposed by no release. Both are found by
  :func:`new_event_fds`, comparing ``/proc/self/fd`` before and after the object is made (both
  are the kernel's ``anon_inode:[infinibandevent]`` files), so waits can ``select()`` on them
  instead of blocking inside ``ibv_get_cq_event`` / ``ibv_get_async_event``, which pyverbs
  calls holding the GIL (the whole interpreter would stop).
- The version: ``pyverbs.__version__`` (after v59), else the distribution metadata (PyPI),
  else the Debian package that owns the module (``dpkg -S``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import TypeVar

from kvtransfer.errors import EngineUnavailableError

PYVERBS_MISSING = ("pyverbs is not installed: install your distribution's rdma-core python bindings "
                   "(Debian/Ubuntu: apt-get install python3-pyverbs)")
# Debian's python3-pyverbs installs here for the system python; a venv of the same minor version
# can import it from there (its extension modules are built for that CPython ABI).
SYSTEM_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
_SUBMODULES = ("device", "pd", "mr", "cq", "qp", "srq", "wr", "addr", "pyverbs_error")
_EVENT_FD_LINK = "anon_inode:[infinibandevent]"
_fd_lock = threading.Lock()
T = TypeVar("T")


def import_pyverbs() -> ModuleType:
    """Import pyverbs and its submodules, falling back to the system dist-packages (Debian
    ``python3-pyverbs``) when the running interpreter has none of its own.

    Raises ``EngineUnavailableError`` with :data:`PYVERBS_MISSING` (or the import error, when a
    pyverbs was found but does not load, e.g. built for another Python).
    """
    try:
        return _import_all()
    except ImportError as first:
        if SYSTEM_DIST_PACKAGES in sys.path or not os.path.isdir(os.path.join(SYSTEM_DIST_PACKAGES, "pyverbs")):
            raise EngineUnavailableError(f"{PYVERBS_MISSING} ({first})") from first
    sys.path.append(SYSTEM_DIST_PACKAGES)
    try:
        return _import_all()
    except ImportError as exc:
        raise EngineUnavailableError(
            f"pyverbs in {SYSTEM_DIST_PACKAGES} does not load in Python {sys.version_info.major}."
            f"{sys.version_info.minor} ({exc}); it is built for the system python3") from exc
    finally:
        sys.path.remove(SYSTEM_DIST_PACKAGES)


def _import_all() -> ModuleType:
    module = importlib.import_module("pyverbs")
    for sub in _SUBMODULES:
        importlib.import_module(f"pyverbs.{sub}")
    return module


@cache
def _enum_modules() -> tuple[ModuleType, ...]:
    import_pyverbs()
    found = []
    for name in ("pyverbs.enums", "pyverbs.libibverbs_enums"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            pass
    if not found:
        raise EngineUnavailableError("this pyverbs has neither pyverbs.enums nor pyverbs.libibverbs_enums")
    return tuple(found)


@cache
def enum(name: str) -> int:
    """The value of the verbs constant ``name`` (e.g. ``"IBV_QPT_RC"``) in this pyverbs.

    Raises ``EngineUnavailableError`` when no enum module of this pyverbs defines it.
    """
    for module in _enum_modules():
        value = getattr(module, name, None)
        if value is not None:
            return int(value)
        for obj in vars(module).values():   # v59+: members of enum classes
            members = getattr(obj, "__members__", None)
            if isinstance(members, Mapping) and name in members:
                return int(members[name])
    raise EngineUnavailableError(f"pyverbs {version().version} defines no {name}")


@dataclass(frozen=True, slots=True)
class PyverbsVersion:
    """Which pyverbs this is: ``version`` (``"44.0"``, or ``"unknown"``), ``origin`` (where it
    came from: the Debian package, the pip distribution, or a path), ``path`` (its ``__init__``)."""

    version: str
    origin: str
    path: str


@cache
def version() -> PyverbsVersion:
    """Version and origin of the importable pyverbs; ``EngineUnavailableError`` if none."""
    module = import_pyverbs()
    path = getattr(module, "__file__", "") or ""
    declared = getattr(module, "__version__", None)
    try:
        meta = importlib.metadata.version("pyverbs")
        return PyverbsVersion(str(declared or meta), f"pip distribution pyverbs {meta}", path)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        owner = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, timeout=10)
        if owner.returncode == 0:
            package = owner.stdout.split(":")[0]
            full = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
            upstream = full.split("-")[0] if full else "unknown"
            return PyverbsVersion(str(declared or upstream), f"Debian package {package} {full}", path)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return PyverbsVersion(str(declared or "unknown"), f"unpackaged module at {path}", path)


def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_FD_LINK:
                fds.add(int(name))
        except OSError:
            pass
    return fds


def new_event_fds(make: Callable[[], T]) -> tuple[T, list[int]]:
    """Call ``make()`` and return its result with the uverbs event fds it opened (sorted).

    Serialised by a module lock so two engines made at once do not see each other's fds; a
    caller that finds more or fewer than it expects treats the fd as unknown.
    """
    with _fd_lock:
        before = _event_fds()
        obj = make()
        return obj, sorted(_event_fds() - before)


def comp_channel_fd(channel: object, discovered: list[int]) -> int | None:
    """The fd of a ``CompChannel``: its ``fd`` property (v59+), else the one fd discovered at
    its creation, else None (the caller then polls with a backoff)."""
    fd = getattr(channel, "fd", None)
    if isinstance(fd, int) and fd >= 0:
        return fd
    return discovered[0] if len(discovered) == 1 else None
