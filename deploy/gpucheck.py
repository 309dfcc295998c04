"""The GPU path checked on a GPU machine in one command, printed as one table.

    python -m deploy.gpucheck prepare [--dir .gpucheck]        # here: PyPI and the SmolLM2 wheel
    python -m deploy.gpucheck run [--dir .gpucheck] [--out DIR] [--quick]   # there: offline

``prepare`` writes ``DIR/tokenizer`` (SmolLM2's tokenizer files, from its GGUF: the GPU machine has
neither the GGUF nor a network) and ``DIR/wheels`` (`WHEELS`: what pdserve needs that the GPU
image lacks, for CPython 3.12 on manylinux x86-64). Add ``/.gpucheck/`` to ``.git/info/exclude``
and carry the folder to the machine.

``run`` installs ``DIR/wheels`` into a scratch folder on ``PYTHONPATH``, then runs, each in its
own process: ``pdserve doctor`` (GPUs, dma-buf, nvidia-peermem, the engine ``auto`` picks), the
cuda tier (``pytest -m "cuda and not rdma"`` with ``PDSERVE_REQUIRE=cuda``: a test that skips for
want of the GPU fails instead; GPUDirect over verbs needs an RDMA NIC the GPU machine lacks) and
`bench.gpu`. It prints one table, each test's outcome and seconds then the
bench's rows, and writes ``gpucheck.json`` (and the logs) into ``--out``. Exit status: 0 when
every test passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "llguidance", "gguf", "grpcio", "protobuf", "openai", "distro", "jiter", "sniffio")
"""Distributions the GPU image lacks (its package list: the device tool's KINDS.md), or holds at
versions older than pdserve's generated stubs accept (grpcio, protobuf)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")


def prepare(folder: Path) -> None:
    """Write ``folder/tokenizer`` and ``folder/wheels`` (module doc). Raises CalledProcessError
    when pip cannot fetch a wheel, ModelLoadError without the SmolLM2 wheel."""
    import transformers

    from engine.modelfile import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(folder / "tokenizer")
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for name in WHEELS:
        try:   # the version this checkout runs with, so the set is known to work together
            name = f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            pass
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "-d", str(wheels), name]
        for p in PLATFORMS:
            cmd[-1:-1] = ["--platform", p]
        subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{folder}: {len(list(wheels.glob('*.whl')))} wheels and the tokenizer, {size / 2**20:.1f} MiB "
          "(the device tool carries 64 MiB a call)")


def _step(name: str, cmd: list[str], env: dict, out: Path, timeout_s: float) -> dict:
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = (out / f"{name}.log").read_text(errors="replace")
    print(f"== {name}: exit {rc} in {time.monotonic() - t0:.0f} s\n{text[-4000:]}", flush=True)
    return {"step": name, "rc": rc, "seconds": time.monotonic() - t0}


def _tests(xml: Path) -> list[dict]:
    """Each test case of a JUnit XML report: name, outcome, seconds, and the message of a
    failure or skip."""
    if not xml.exists():
        return []
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, message = tag.replace("failure", "failed"), (el.get("message") or "")[:160]
        rows.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time", 0)), "message": message})
    return rows


def run(folder: Path, out: Path, quick: bool) -> int:
    """Install the carried wheels, run doctor, the cuda tier and the bench; print the table."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDSERVE_REQUIRE="cuda",
               PDSERVE_TOKENIZER_DIR=str((folder / "tokenizer").resolve()))
    wheels = sorted((folder / "wheels").glob("*.whl"))
    if wheels:
        site = Path("/tmp/pdserve-gpucheck-site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    steps = [_step("doctor", [sys.executable, "-m", "deploy.cli", "doctor"], env, out, 120),
             _step("cuda-tier", [sys.executable, "-m", "pytest", "-m", "cuda and not rdma", "-q", "-p", "no:cacheprovider",
                                 "--junitxml", str(out / "cuda.xml"), "tests"], env, out, 1500)]
    bench = [sys.executable, "-m", "bench.gpu", "--json", str(out / "bench.json")] + (["--quick"] if quick else [])
    steps.append(_step("bench", bench, env, out, 900))
    tests = _tests(out / "cuda.xml")
    bench_rows = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
    print("\n| check | outcome | seconds | note |\n|---|---|---|---|")
    for s in steps:
        print(f"| step {s['step']} | exit {s['rc']} | {s['seconds']:.0f} | |")
    for t in tests:
        print(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['message']} |")
    for r in bench_rows.get("rows", []):
        print(f"| bench {r['weights']} {'compiled' if r['compiled'] else 'eager'} {r['phase']} x{r['batch']} | "
              f"{r['ratio']:.2f}x transformers | | {r['pdserve_tok_s']:.0f} vs {r['transformers_tok_s']:.0f} tok/s |")
    if "cuda_ipc" in bench_rows:
        ipc = bench_rows["cuda_ipc"]
        print(f"| bench cuda_ipc | {ipc['ratio']:.2f}x the copy ceiling | | {ipc['ipc_gb_s']:.1f} vs "
              f"{ipc['copy_gb_s']:.1f} GB/s, {ipc['bytes_per_write'] / 2**20:.2f} MiB per write |")
    (out / "gpucheck.json").write_text(json.dumps({"steps": steps, "tests": tests, "bench": bench_rows}, indent=1))
    failed = [t for t in tests if t["outcome"] in ("failed", "error")]
    return 0 if tests and not failed and all(s["rc"] == 0 for s in steps) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.gpucheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "run"])
    ap.add_argument("--dir", default=str(ROOT / ".gpucheck"), help="the carried folder")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpucheck-out"), help="run: where results go")
    ap.add_argument("--quick", action="store_true", help="run: the bench's smoke sizes")
    args = ap.parse_args(argv)
    if args.what == "prepare":
        prepare(Path(args.dir))
        return 0
    return run(Path(args.dir), Path(args.out), args.quick)


if __name__ == "__main__":
    sys.exit(main())
