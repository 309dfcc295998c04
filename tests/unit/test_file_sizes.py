"""No Python file is over 500 lines (CONVENTIONS.md, habit 1: a file past ~500 lines is asking to
be split). Generated code (``rpc/pdserve_pb2*.py``), the virtual environment and hidden folders
are not counted. The files are git's (tracked, or new and not ignored); outside a git checkout,
every ``.py`` file under the root."""

from __future__ import annotations

import fnmatch
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
GENERATED = ("rpc/pdserve_pb2*.py",)


def _excluded(rel: str) -> bool:
    parts = rel.split("/")
    return (parts[0] == ".venv" or any(p.startswith(".") for p in parts[:-1])
            or any(fnmatch.fnmatch(rel, g) for g in GENERATED))


def python_files(root: Path) -> list[str]:
    """Paths relative to ``root`` (with ``/``) of the ``.py`` files the limit applies to."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "--", "*.py"],
                             capture_output=True, check=True, timeout=60).stdout.decode()
        found = [p for p in out.split("\0") if p and (root / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(folder).relative_to(root)
            found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(p for p in set(found) if not _excluded(p))


def oversized(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for each file over ``limit`` lines."""
    out = []
    for rel in python_files(root):
        with open(root / rel, "rb") as f:
            n = sum(1 for _ in f)
        if n > limit:
            out.append(f"{rel}: {n} lines")
    return out


def test_no_python_file_is_over_500_lines():
    bad = oversized(ROOT)
    assert not bad, f"over {MAX_LINES} lines (split by concept): {bad}"


def test_a_501_line_file_is_reported_and_500_is_not(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * 501)
    (tmp_path / "pkg" / "fits.py").write_text("x = 1\n" * 500)
    assert oversized(tmp_path) == ["pkg/big.py: 501 lines"]


def test_generated_venv_and_hidden_files_are_not_counted(tmp_path):
    for rel in ("rpc/pdserve_pb2.py", "rpc/pdserve_pb2_grpc.py", ".venv/lib/site.py", ".git/hooks/x.py",
                "pkg/.cache/y.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n" * 600)
    (tmp_path / "rpc" / "server.py").write_text("x = 1\n" * 600)
    assert oversized(tmp_path) == ["rpc/server.py: 600 lines"]
