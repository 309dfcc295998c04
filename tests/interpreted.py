"""Run a module of cases under Triton's interpreter in a process of its own: Triton decides when it
is imported whether its kernels are interpreted (``TRITON_INTERPRET=1``), and another test may have
imported it first. The Triton kernels' CPU tests (attention, range copy, CUDA-graph buffers) use
this."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, *args: str, timeout_s: float = 300) -> str:
    """``python -m module *args`` with ``TRITON_INTERPRET=1`` in the repository root: its stdout.
    Skips without triton (the dev extra); fails the test, with the stderr tail, when it exits
    non-zero."""
    pytest.importorskip("triton", reason="triton is in the dev extra")
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
