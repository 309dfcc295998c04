"""The 4-bit projections' plans, timed once per machine and read back by every later load.

A plan says, for passes on one torch thread count, which low-bit kernel the 4-bit projections run
and up to how many rows, the dequantized copy taking larger passes (`engine.quant.Int4Linear`,
timed by `engine.quant.choose_low_bit_plans`). The kernels round differently, so two processes
holding different plans can answer one greedy request differently where its two best tokens
nearly tie. A timing taken while other processes load or serve varies from run to run, so every
worker timing its own let a prefill worker and a decode worker (or a worker and the engine a test
compares it with) disagree on such a request. Timed once and kept, every process on the machine
holds the same plan, and a restart holds the one it had: what autotuners do (Triton's autotune
cache, vLLM's tuned fused-MoE configs per device).

A plan is kept per thread count in ``<inductor's cache>/pdserve-tuning/low-bit-<key>.json``, beside
`engine.aot_kernel.cache_dir`'s packages. Its key (`plan_key`) holds the thread count, the
projections' shapes and dense dtype, torch's and onnxruntime's versions, the CPU's model and flags,
and the source of the modules that time and run the kernels: a change to any of them times again.
Delete the files to time again on purpose. Loads take a lock on the directory while they read,
time and write, so workers starting together time once, one after the other's timing rather than
during it. A file that cannot be read back is timed again and replaced, with a warning naming it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from engine import aot_kernel, mlas, quant
from engine.quant import LOW_BIT_KERNELS, choose_low_bit_plans

log = logging.getLogger(__name__)

SUBDIR = "pdserve-tuning"


def tuning_dir() -> Path:
    """Where plans are kept: ``pdserve-tuning`` beside `engine.aot_kernel.cache_dir`
    (``$TORCHINDUCTOR_CACHE_DIR``, else inductor's default ``<tmp>/torchinductor_<user>``)."""
    return aot_kernel.cache_dir().parent / SUBDIR


def plan_key(linears: list, threads: int) -> str:
    """The key (hex, 32 characters) of the plan for ``linears`` (`engine.quant.Int4Linear`, in
    forward order) on ``threads`` torch threads: SHA-256 of the thread count, each linear's
    ``(out_features, in_features)``, the dense copies' dtype (`engine.quant.dense_dtype`),
    torch's and onnxruntime's versions, the CPU's model and flags (as
    `engine.aot_kernel.package_key` reads them), and the bytes of `engine.quant`, `engine.mlas`
    and this module."""
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    h = hashlib.sha256()
    h.update(json.dumps({"threads": threads, "torch": torch.__version__, "onnxruntime": ort,
                         "cpu": aot_kernel._cpu_identity(),
                         "dense": str(quant.dense_dtype()),
                         "linears": [(p.out_features, p.in_features) for p in linears]},
                        sort_keys=True).encode())
    for module in (quant, mlas):
        h.update(Path(module.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:32]


def tuned_low_bit_plans(linears: list, thread_counts: tuple[int, ...]) -> tuple[dict[int, tuple[str, int]], str]:
    """Give ``linears`` their plan for each of ``thread_counts`` (`Int4Linear.set_plans`): the
    kept one where `tuning_dir` holds it, else timed now (`engine.quant.choose_low_bit_plans`) and
    kept. Without a usable directory (it or its lock file cannot be made or opened) the plans are
    timed and used, with a warning that they are not kept; one that cannot be written to, the same.

    Args:
        linears: `engine.quant.Int4Linear` objects built with both low-bit kernels, in forward order.
        thread_counts: the torch thread counts passes run on.
    Returns:
        ``({threads: (kernel, max_rows)}, how)``: ``how`` says for the log which plans were read
        back and which timed.
    Raises:
        ValueError: no thread count, or one below 1 (`choose_low_bit_plans`).
    """
    counts = sorted(set(thread_counts))
    directory = tuning_dir()
    files = {n: directory / f"low-bit-{plan_key(linears, n)}.json" for n in counts}
    with ExitStack() as held:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            held.enter_context(_locked(directory / ".lock"))
        except OSError as e:
            log.warning("low-bit plans timed and not kept: %s cannot be used (%s)", directory, e)
            return choose_low_bit_plans(linears, counts), "timed, not kept"
        known = {n: plan for n in counts if (plan := _read(files[n], n)) is not None}
        plans = choose_low_bit_plans(linears, counts, known=known)
        timed = [n for n in counts if n not in known]
        kept = all([_write(files[n], n, plans[n]) for n in timed])
    how = f"read from {directory}" if not timed else (
        f"timed on {', '.join(map(str, timed))} thread(s) and {'kept in' if kept else 'not kept:'} {directory}")
    return plans, how


@contextmanager
def _locked(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (made if absent). Raises OSError: it cannot be opened."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # released on close, or by the kernel if this process dies
        yield


def _read(path: Path, threads: int) -> tuple[str, int] | None:
    """The plan kept in ``path`` for ``threads``, or None (absent, or refused with a warning)."""
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        kernel, rows = entry["kernel"], entry["max_rows"]
        if entry["threads"] != threads:
            raise ValueError(f"'threads' is {entry['threads']!r}, not {threads}")
        if kernel not in LOW_BIT_KERNELS:
            raise ValueError(f"'kernel' is {kernel!r}, not one of {LOW_BIT_KERNELS}")
        if type(rows) is not int or rows < 0:
            raise ValueError(f"'max_rows' is {rows!r}, not a row count")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("low-bit plan %s not used, timed again: %s", path, e)
        return None
    return kernel, rows


def _write(path: Path, threads: int, plan: tuple[str, int]) -> bool:
    """Keep ``plan`` in ``path``; False (with a warning) where it cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"threads": threads, "kernel": plan[0], "max_rows": plan[1]}) + "\n")
        os.replace(tmp, path)   # readers see the old file or the whole new one
        return True
    except OSError as e:
        log.warning("low-bit plan for %d thread(s) not kept in %s: %s", threads, path, e)
        tmp.unlink(missing_ok=True)
        return False
