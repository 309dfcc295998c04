"""Kernels compiled ahead of time by AOTInductor and kept on disk, for the CPU attention kernels
(`engine.paged_decode.CompiledDecode`, `engine.flex_prefill.CompiledPrefill`) and the operators
between a layer's matmuls (`engine.glue.CompiledGlue`).

A kernel is a ``torch.nn.Module`` exported with ``torch.export`` (dynamic sizes where the kernel
takes any) and compiled by ``torch._inductor.aoti_compile_and_package`` into a package (a ``.pt2``
zip holding a shared library of inductor's generated C++, PyTorch's "AOTInductor" documentation).
`load_or_build` loads that package through the AOTInductor runtime
(``torch._C._aoti.AOTIModelPackageLoader``, the binding of the C++ ``AOTIModelPackageLoader``)
when the cache holds it, else exports, compiles and stores it first. Loading needs neither dynamo
nor inductor: a restarted worker neither imports them nor traces the kernel again (what
``torch.compile`` does at every start, cache warm or not), and a call has no guards to check.

The package is native code for one machine and one build: its cache key (`package_key`) holds
the kernel's name and static parameters, the torch thread count (inductor writes its OpenMP
loops for it), torch's version, the CPU's model and instruction-set flags, and the source of the
modules that define the kernel, so any change to them builds a new package. Packages live in
``<inductor's cache>/pdserve-aot/`` (``TORCHINDUCTOR_CACHE_DIR``, else inductor's default
``<tmp>/torchinductor_<user>``), written to a temporary name and renamed into place, so workers
starting together never read half a package; one that cannot be loaded is built again.

A package is built by one process at a time: the build holds an exclusive ``flock`` on the
package's lock file beside it, and a second process that wants the same package waits for it and
loads what the first built. Under `defer_busy` it does not wait: `PackageBusy` tells it to build
something else first (`worker.kernels` walks a kernel's thread counts so), so two workers starting
together on one machine share a kernel's packages between them instead of building each twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import getpass
import hashlib
import json
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUBDIR = "pdserve-aot"


def cache_dir() -> Path:
    """Where packages are kept: ``$TORCHINDUCTOR_CACHE_DIR/pdserve-aot``, else inductor's
    default cache directory (``<tmp>/torchinductor_<user>``, as
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir`` names it) + ``/pdserve-aot``."""
    # computed here: importing torch._inductor's own helper would import dynamo and inductor,
    # what loading a package avoids
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        try:
            user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        except (KeyError, OSError):
            user = "unknown"
        base = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return Path(base) / SUBDIR


def _cpu_identity() -> str:
    """The CPU's model name and flags from /proc/cpuinfo (``platform.machine`` elsewhere): the
    generated code is built with ``-march=native``."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    norm = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{norm.get('model name', '')}|{' '.join(sorted(norm.get('flags', '').split()))}"


def package_key(name: str, params: dict, sources: list[str | Path]) -> str:
    """The cache key of kernel ``name`` (hex, 32 characters): SHA-256 of ``params`` (its static
    parameters, JSON with ``str`` for what JSON cannot hold), the torch thread count, torch's
    version, `_cpu_identity`, and the bytes of each file in ``sources`` and of this module."""
    h = hashlib.sha256()
    h.update(json.dumps({"name": name, "params": params, "threads": torch.get_num_threads(),
                         "torch": torch.__version__, "cpu": _cpu_identity()},
                        sort_keys=True, default=str).encode())
    for src in [*sources, __file__]:
        h.update(Path(src).read_bytes())
    return h.hexdigest()[:32]


class AotPackage:
    """One loaded package: ``package(*tensors)`` runs it and returns its outputs (a list of
    tensors). Inputs must have the sizes the export allowed and the dtypes and strides of its
    example inputs (the runtime does not check them: the kernels calling it key their packages
    by them). ``path``: the ``.pt2`` file; ``built``: whether this process compiled it;
    ``seconds``: what loading (and building) took."""

    def __init__(self, path: Path, built: bool, seconds: float):
        self.path, self.built, self.seconds = path, built, seconds
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self._loader.run(list(tensors))


def configure_inductor() -> None:
    """Inductor as `load_or_build` compiles: in the calling process (``compile_threads = 1``: no
    pool of compile workers left running), the CPU's vector instructions taken from torch's own
    detection (``cpp.vec_isa_ok``) unless ``TORCHINDUCTOR_VEC_ISA_OK`` set it (no probe libraries
    built and loaded in child processes)."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    if inductor_config.cpp.vec_isa_ok is None:
        inductor_config.cpp.vec_isa_ok = True


def _build(path: Path, export: Callable[[], "torch.export.ExportedProgram"],
           codegen: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
    import torch._inductor

    configure_inductor()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    try:
        with warnings.catch_warnings():   # torch's own deprecation notices from inside export's pytrees
            warnings.simplefilter("ignore", FutureWarning)
            program = export()
            with codegen() if codegen is not None else contextlib.nullcontext():
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class PackageBusy(RuntimeError):
    """`load_or_build` under `defer_busy`: the package is not on disk and another process holds
    its build lock (is building it now). Nothing was built or loaded; ask again later, or outside
    `defer_busy` to wait for that build and load its package."""


_DEFER = contextvars.ContextVar("pdserve_aot_defer", default=False)


@contextlib.contextmanager
def defer_busy():
    """Within this block `load_or_build` raises `PackageBusy` instead of waiting for a package
    another process is building (in this thread or task only)."""
    token = _DEFER.set(True)
    try:
        yield
    finally:
        _DEFER.reset(token)


def _load(path: Path, name: str, t0: float) -> AotPackage | None:
    """The package at ``path`` loaded, None when absent; one the runtime refuses is removed
    (with a warning) so that it is built again."""
    if not path.exists():
        return None
    try:
        return AotPackage(path, False, time.perf_counter() - t0)
    except RuntimeError as exc:
        log.warning("%s: cannot load %s (%s); building it again", name, path, str(exc).splitlines()[0])
        path.unlink(missing_ok=True)
        return None


def load_or_build(name: str, params: dict, sources: list[str | Path],
                  export: Callable[[], "torch.export.ExportedProgram"],
                  codegen: Callable[[], contextlib.AbstractContextManager] | None = None) -> AotPackage:
    """The package of kernel ``name`` with ``params`` (`package_key`) for the current thread
    count: loaded from `cache_dir` when there, else ``export()`` (a ``torch.export`` program of
    the kernel) compiled by AOTInductor (`configure_inductor`; inside ``codegen()``, a context
    that adjusts inductor's code generation, when given), stored, then loaded. A stored
    package the runtime refuses (truncated, say) is built again, with a warning. The build holds
    the package's lock (module doc): a process that finds it held waits, then loads the package
    built meanwhile; under `defer_busy` it raises `PackageBusy` at once. Raises whatever export or
    inductor raise where they cannot build (no C++ compiler, an operator export does not take),
    and OSError when the cache cannot be written."""
    t0 = time.perf_counter()
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{package_key(name, params, sources)}.pt2"
    package = _load(path, name, t0)
    if package is not None:
        return package
    with open(path.with_name(f".{path.stem}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (fcntl.LOCK_NB if _DEFER.get() else 0))
        except BlockingIOError:
            raise PackageBusy(f"{name}: {path.name} is being built by another process") from None
        package = _load(path, name, t0)   # built by the lock's holder while this one waited
        if package is not None:
            return package
        _build(path, export, codegen)   # the lock is released on close, or by the kernel if this dies
    return AotPackage(path, True, time.perf_counter() - t0)


def package_for(packages: dict[tuple, AotPackage], name: str, key: tuple, sources: list[str | Path],
                export: Callable[[], "torch.export.ExportedProgram"],
                codegen: Callable[[], contextlib.AbstractContextManager] | None = None) -> AotPackage:
    """A kernel's package for its static ``key`` (sizes, strides, dtypes, constants: whatever the
    exported program fixes) on the current thread count, kept in ``packages`` under
    ``(threads, *key)`` for the calls after this one; the first loads or builds it
    (`load_or_build`, the key as its parameters). Raises as `load_or_build`."""
    full = (torch.get_num_threads(), *key)
    package = packages.get(full)
    if package is None:
        package = packages[full] = load_or_build(name, {"key": list(key)}, sources, export, codegen)
    return package
