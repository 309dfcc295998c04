#!/usr/bin/env python3
"""Write the image build context as a tar stream (for ``docker build -f deploy/Dockerfile -``).

    python3 deploy/docker/context.py --wheels DIR > context.tar

The context holds the repository's files (``git ls-files``: tracked and untracked-but-not-ignored,
so no ``.venv``, ``.git`` or caches; without git, a walk that skips those) plus the wheels of DIR
under ``deploy/wheels/``. Owners and times are normalised, so an unchanged tree hits the builder's
layer cache. This replaces a ``.dockerignore`` (the classic builder reads one only at the context
root) and keeps the torch wheel out of the repository.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "build", "dist", "bench-results"}
SKIP_SUFFIXES = (".pyc", ".log", ".egg-info")
# Never in an image, even when untracked and not ignored: the cluster secret.
SKIP_FILES = {"deploy/cluster.env"}


def repo_files(repo: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                             check=True, capture_output=True).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for root, dirs, files in os.walk(repo):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(SKIP_SUFFIXES)]
            names += [os.path.relpath(os.path.join(root, f), repo) for f in files]
    return sorted(n for n in names
                  if not n.startswith("deploy/wheels/") and not n.endswith(SKIP_SUFFIXES)
                  and n not in SKIP_FILES
                  and (repo / n).is_file())


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    info.mode = 0o755 if info.mode & 0o111 else 0o644
    return info


def write_context(out, repo: Path, wheels: Path | None) -> None:
    with tarfile.open(fileobj=out, mode="w|", dereference=True) as tar:
        for name in repo_files(repo):
            tar.add(repo / name, arcname=name, recursive=False, filter=_normalise)
        dir_info = _normalise(tarfile.TarInfo("deploy/wheels"))
        dir_info.type, dir_info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(dir_info)
        for whl in sorted(wheels.glob("*.whl")) if wheels else []:
            tar.add(whl, arcname=f"deploy/wheels/{whl.name}", recursive=False, filter=_normalise)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=None, help="directory of wheels to ship as deploy/wheels/")
    ap.add_argument("--repo", type=Path, default=REPO)
    args = ap.parse_args()
    write_context(sys.stdout.buffer, args.repo, args.wheels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
