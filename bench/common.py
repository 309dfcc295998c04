"""What every benchmark shares: its command line, timing a call, and the JSON record it writes.

`arg_parser` names the benchmark as it is run (``python -m bench.<name>``). `timed` and
`median_time` time a callable with `time.perf_counter`, after untimed warm-up calls.
`write_json` writes a benchmark's result under a `header` that says where and when it ran (UTC
date, CPU model and the SIMD flags the kernels depend on, torch version and threads, command line,
git commit), so that a figure in a results file can be traced back to its machine and its code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")
"""The /proc/cpuinfo flags a header reports: those that decide which CPU kernels torch and
onnxruntime run."""
ROOT = Path(__file__).resolve().parents[1]


def arg_parser(module: str, description: str) -> argparse.ArgumentParser:
    """A benchmark's parser: usage names ``python -m <module>``; ``description`` (the module
    docstring, or its first line) is printed as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def timed(fn: Callable[[], object], iters: int, warmup: int = 1) -> list[float]:
    """Seconds taken by each of ``iters`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds of one call of ``fn`` over ``reps`` timed calls (after ``warmup`` untimed)."""
    return statistics.median(timed(fn, reps, warmup))


def cpu(cpuinfo: str | None = None) -> dict:
    """``{"model", "flags"}``: the CPU model and, for each of `CPU_FLAGS`, whether it has it.

    Read from ``cpuinfo`` (the text of /proc/cpuinfo; read here when None). Where there is no
    /proc/cpuinfo (not Linux), the model is what `platform` says and ``flags`` is None: unknown.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"model": platform.processor() or platform.machine(), "flags": None}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    present = set(fields.get("flags", "").split())
    return {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "flags": {flag: flag in present for flag in CPU_FLAGS}}


def git_commit(root: Path = ROOT) -> str:
    """``git rev-parse --short HEAD`` in ``root``; ``"unknown"`` when that is not a git checkout
    or git is missing. ``PDSERVE_COMMIT``, where set, wins: a copy of the working tree sent to
    another machine may carry older git metadata (`deploy.gpucheck` sets it from ``prepare``)."""
    if os.environ.get("PDSERVE_COMMIT"):
        return os.environ["PDSERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def header(args: argparse.Namespace | None = None) -> dict:
    """Where and when a benchmark ran: ``date`` (UTC, ISO 8601, seconds), ``cpu`` (`cpu`),
    ``torch`` (version), ``torch_threads``, ``command`` (this process's command line),
    ``commit`` (`git_commit`) and, when ``args`` is given, ``options`` (the parsed options: they
    differ from the command line when a test calls a benchmark's ``main(argv)``)."""
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "command": shlex.join(sys.orig_argv), "commit": git_commit()}
    if args is not None:
        out["options"] = vars(args)
    return out


def write_json(path: str | Path, result: dict, args: argparse.Namespace | None = None) -> Path:
    """Write ``{"header": header(args), **result}`` to ``path`` as indented JSON, creating its
    parent directories; a value JSON cannot hold (a path, say) is written as its ``str``.
    Returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header(args), **result}, indent=2, default=str) + "\n")
    return path
