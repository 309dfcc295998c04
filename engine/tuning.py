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

Other choices a worker times at start-up are kept the same way (`kept_timings`): the prompt
attention's kernel against SDPA (`engine.prefill_choice`), whose two sides can be within the
timing's noise at some lengths, so that every start would otherwise draw its own choice, and the
prompt tokens a pass batches up to (`engine.prefill_knee`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable

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
    """The key (`_key`) of the plan for ``linears`` (`engine.quant.Int4Linear`, in forward order)
    on ``threads`` torch threads: the thread count, each linear's ``(out_features,
    in_features)``, the dense copies' dtype (`engine.quant.dense_dtype`), onnxruntime's version,
    and the bytes of `engine.quant` and `engine.mlas`."""
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    return _key({"threads": threads, "onnxruntime": ort, "dense": str(quant.dense_dtype()),
                 "linears": [(p.out_features, p.in_features) for p in linears]}, (quant.__file__, mlas.__file__))


def _key(fields: dict, sources: tuple[str, ...]) -> str:
    """A kept file's key, 32 hex characters: SHA-256 of ``fields`` (JSON-serializable) with
    torch's version and the CPU's model and flags (as `engine.aot_kernel.package_key` reads them),
    then the bytes of the files ``sources`` and of this module."""
    h = hashlib.sha256(json.dumps({**fields, "torch": torch.__version__, "cpu": aot_kernel._cpu_identity()},
                                  sort_keys=True).encode())
    for source in (*sources, __file__):
        h.update(Path(source).read_bytes())
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
    with _held_directory("low-bit plans") as directory:
        if directory is None:
            return choose_low_bit_plans(linears, counts), "timed, not kept"
        files = {n: directory / f"low-bit-{plan_key(linears, n)}.json" for n in counts}
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


@contextmanager
def _held_directory(what: str):
    """`tuning_dir`, made if absent and locked (`_locked` on its ``.lock``) while the block runs;
    None, with a warning that ``what`` is timed and not kept, where it cannot be made or locked."""
    directory = tuning_dir()
    with ExitStack() as held:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            held.enter_context(_locked(directory / ".lock"))
        except OSError as e:
            log.warning("%s timed and not kept: %s cannot be used (%s)", what, directory, e)
            directory = None
        yield directory


def kept_timings(name: str, identity: dict, sources: tuple[str, ...], measure: Callable[[], dict],
                 check: Callable[[dict], None]) -> tuple[dict, str]:
    """Timings kept per machine: read back from ``<tuning_dir>/<name>-<key>.json`` where a load
    kept them, else ``measure()`` now and kept, under `tuning_dir`'s lock (as the low-bit plans).

    Args:
        name: what is timed (letters, digits and dashes; the file's prefix).
        identity: what the timings depend on besides the machine (shapes, dtypes, thread count),
            JSON-serializable; the file's key (`_key`) hashes it with the machine and the bytes of
            the files ``sources``.
        measure: times now; returns a JSON-serializable dict (string keys).
        check: raises ValueError, KeyError or TypeError for an entry that is not such a dict (a
            file refused by it is timed again and replaced, with a warning naming it).
    Returns:
        ``(timings, how)``: ``how`` says for the log where they came from ("read from DIR",
        "timed and kept in DIR", or why they were not kept).
    Raises:
        whatever ``measure`` raises.
    """
    with _held_directory(name) as directory:
        if directory is None:
            return measure(), "timed, not kept"
        path = directory / f"{name}-{_key({'identity': identity}, sources)}.json"
        if (entry := _read_entry(path, check)) is not None:
            return entry, f"read from {directory}"
        entry = measure()
        return entry, f"timed and {'kept in' if _write_entry(path, entry) else 'not kept:'} {directory}"


def _read(path: Path, threads: int) -> tuple[str, int] | None:
    """The plan kept in ``path`` for ``threads``, or None (absent, or refused with a warning)."""

    def check(entry: dict) -> None:
        kernel, rows = entry["kernel"], entry["max_rows"]
        if entry["threads"] != threads:
            raise ValueError(f"'threads' is {entry['threads']!r}, not {threads}")
        if kernel not in LOW_BIT_KERNELS:
            raise ValueError(f"'kernel' is {kernel!r}, not one of {LOW_BIT_KERNELS}")
        if type(rows) is not int or rows < 0:
            raise ValueError(f"'max_rows' is {rows!r}, not a row count")

    entry = _read_entry(path, check)
    return None if entry is None else (entry["kernel"], entry["max_rows"])


def _write(path: Path, threads: int, plan: tuple[str, int]) -> bool:
    """Keep ``plan`` in ``path``; False (with a warning) where it cannot be written."""
    return _write_entry(path, {"threads": threads, "kernel": plan[0], "max_rows": plan[1]})


def _read_entry(path: Path, check: Callable[[dict], None]) -> dict | None:
    """The JSON object kept in ``path`` that ``check`` accepts, or None (absent, or refused
    with a warning naming the file and the cause)."""
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict):
            raise TypeError(f"a JSON {type(entry).__name__}, not an object")
        check(entry)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s not used, timed again: %s", path, e)
        return None
    return entry


def _write_entry(path: Path, entry: dict) -> bool:
    """Keep ``entry`` in ``path`` (written whole, then renamed over it); False (with a warning)
    where it cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(entry) + "\n")
        os.replace(tmp, path)   # readers see the old file or the whole new one
        return True
    except OSError as e:
        log.warning("timings not kept in %s: %s", path, e)
        tmp.unlink(missing_ok=True)
        return False
