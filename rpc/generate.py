"""Regenerate the gRPC stubs from ``rpc/pdserve.proto``: ``python -m rpc.generate [--check]``.

``--check`` generates into a temporary directory and exits 1 when the committed stubs differ
(tests/unit/test_rpc_stubs.py runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "rpc/pdserve.proto"
OUTPUTS = ("rpc/pdserve_pb2.py", "rpc/pdserve_pb2.pyi", "rpc/pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) writing the stubs under ``out_dir/rpc``."""
    from grpc_tools import protoc

    (out_dir / "rpc").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + PROTO)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare with the committed stubs")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if args.check:
            stale = [o for o in OUTPUTS if not (ROOT / o).exists()
                     or not filecmp.cmp(Path(tmp) / o, ROOT / o, shallow=False)]
            if stale:
                print("stale generated stubs: " + ", ".join(stale) + " (run python -m rpc.generate)")
                return 1
            return 0
        for o in OUTPUTS:
            shutil.copyfile(Path(tmp) / o, ROOT / o)
    return 0


if __name__ == "__main__":
    sys.exit(main())
