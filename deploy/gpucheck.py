"""The GPU path checked on a GPU machine in one command, printed as one table.

    python -m deploy.gpucheck prepare [--dir .gpucheck]        # here: PyPI and the SmolLM2 wheel
    python -m deploy.gpucheck run [--dir .gpucheck] [--out DIR] [--quick]   # there: offline

``prepare`` writes ``DIR/tokenizer`` (SmolLM2's tokenizer files, from its GGUF: the GPU machine has
neither the GGUF nor a network), ``DIR/commit`` (the checkout's commit, which the results name: the
copy sent may carry older git metadata) and ``DIR/wheels`` (`WHEELS`: what pdserve needs that the GPU
image lacks, for CPython 3.12 on manylinux x86-64). Add ``/.gpucheck/`` to ``.git/info/exclude``
and carry the folder to the machine.

``run`` installs ``DIR/wheels`` into a scratch folder on ``PYTHONPATH``, prints the GPU and the
versions it found, then runs within ``--budget-s`` seconds, each in its own process group: ``pdserve
doctor`` (GPUs, dma-buf, nvidia-peermem, the engine ``auto`` picks), the cuda tier (``pytest -m
"cuda and not rdma"`` with ``PDSERVE_REQUIRE=cuda``: a test that skips for want of the GPU fails
instead; GPUDirect over verbs needs an RDMA NIC the GPU machine lacks) and `bench.gpu` (given what
time is left: it prints and saves each row as it goes and starts no section it cannot finish). It
prints one table, each test's outcome and seconds then the bench's rows, and writes
``gpucheck.json`` (and the logs) into ``--out``. Exit status: 0 when every test passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "llguidance", "gguf", "grpcio", "protobuf", "openai", "distro", "jiter", "sniffio", "opentelemetry-api",
          "typing-extensions")
"""Distributions the GPU image lacks (its package list: the device tool's KINDS.md), or holds at
versions older than pdserve's generated stubs (grpcio, protobuf) or pydantic (typing-extensions)
accept; opentelemetry-api is fastapi's."""
TIER_PATHS = ("tests/unit", "tests/integration")
"""Where the cuda tier is collected from: tests/e2e holds no cuda test (tests/unit/test_gpucheck.py
checks) and needs packages the GPU image lacks (schemathesis, jsonschema, lm-eval)."""
CPU_REFERENCE_TEST = "tests/integration/test_engine_reference.py::test_cuda_engine_matches_cpu_greedy"
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
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    (folder / "commit").write_text((git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if dirty else ""))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{folder}: {len(list(wheels.glob('*.whl')))} wheels and the tokenizer, {size / 2**20:.1f} MiB "
          "(the device tool carries 64 MiB a call)")


def _step(name: str, cmd: list[str], env: dict, out: Path, timeout_s: float) -> dict:
    """Run ``cmd`` in its own process group with its output in ``out/name.log``; on timeout the
    whole group is killed (pytest-xdist workers and the workers tests start hold the GPU)."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    text = (out / f"{name}.log").read_text(errors="replace")
    print(f"== {name}: exit {rc} in {time.monotonic() - t0:.0f} s (limit {timeout_s:.0f} s)\n{text[-6000:]}", flush=True)
    return {"step": name, "rc": rc, "seconds": time.monotonic() - t0}


def _tests(xml: Path, log: Path) -> list[dict]:
    """Each test case of a JUnit XML report: name, outcome, seconds, and the message of a
    failure or skip. Without the report (pytest killed at its limit), the outcomes its ``-v`` log
    shows so far."""
    if not xml.exists():
        rows = []
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            for outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
                if f" {outcome}" in line and "::" in line:
                    test = line.split()[-1] if line.startswith("[") else line.split()[0]
                    rows.append({"test": test.split("/")[-1], "outcome": outcome.lower(), "seconds": 0.0,
                                 "message": "(from the log)"})
                    break
        return rows
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


def run(folder: Path, out: Path, quick: bool, budget_s: float, workers: int, bench_args: list[str]) -> int:
    """Install the carried wheels, run doctor, the cuda tier and the bench within ``budget_s``
    seconds in all; print the table."""
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDSERVE_REQUIRE="cuda",
               PDSERVE_TOKENIZER_DIR=str((folder / "tokenizer").resolve()))
    if (folder / "commit").exists():   # the checkout's commit at prepare (`bench.common.git_commit`)
        env["PDSERVE_COMMIT"] = (folder / "commit").read_text().strip()
    wheels = sorted((folder / "wheels").glob("*.whl"))
    if wheels:
        site = Path("/tmp/pdserve-gpucheck-site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "-L"], check=False)
    versions = subprocess.run([sys.executable, "-c", "import torch, transformers, triton, cupy, grpc; print('torch', "
                               "torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(), "
                               "'transformers', transformers.__version__, 'triton', triton.__version__, 'cupy', "
                               "cupy.__version__, 'grpcio', grpc.__version__)"], env=env, capture_output=True, text=True)
    print(versions.stdout, versions.stderr[-2000:], flush=True)

    def left() -> float:
        return budget_s - (time.monotonic() - t0)

    steps = [_step("doctor", [sys.executable, "-m", "deploy.cli", "doctor"], env, out, min(60.0, left()))]
    pytest_cmd = [sys.executable, "-m", "pytest", "-m", "cuda and not rdma", "-v", "-p", "no:cacheprovider",
                  "--junitxml", str(out / "cuda.xml"), *TIER_PATHS]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        pytest_cmd[3:3] = ["-n", str(workers)]
    try:
        from engine.modelfile import default_model_path

        default_model_path()
    except Exception as exc:   # noqa: BLE001 - the GGUF wheel (93 MB) does not travel to the GPU machine
        print(f"deselected (its fixture needs SmolLM2's GGUF; the smollm2-shapes checkpoints stand in): "
              f"{CPU_REFERENCE_TEST}: {exc}")
        pytest_cmd[3:3] = ["--deselect", CPU_REFERENCE_TEST]
    steps.append(_step("cuda-tier", pytest_cmd, env, out, left() * (0.4 if quick else 0.55)))
    bench_s = left() - 15
    bench = [sys.executable, "-m", "bench.gpu", "--json", str(out / "bench.json"), "--deadline-s", f"{bench_s - 45:.0f}"]
    steps.append(_step("bench", bench + (["--quick"] if quick else []) + bench_args, env, out, bench_s))
    tests = _tests(out / "cuda.xml", out / "cuda-tier.log")
    bench_rows = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
    print("\n| check | outcome | seconds | note |\n|---|---|---|---|")
    for s in steps:
        print(f"| step {s['step']} | exit {s['rc']} | {s['seconds']:.0f} | |")
    for t in tests:
        print(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['message']} |")
    for r in bench_rows.get("rows", []):
        print(f"| bench {r['weights']} {r['step']} {r['phase']} x{r['batch']} | "
              f"{r['ratio']:.2f}x transformers | | {r['pdserve_tok_s']:.0f} vs {r['transformers_tok_s']:.0f} tok/s |")
    if "cuda_ipc" in bench_rows:
        ipc = bench_rows["cuda_ipc"]
        print(f"| bench cuda_ipc | {ipc['ratio']:.2f}x the copy ceiling | | {ipc['ipc_gb_s']:.1f} vs "
              f"{ipc['copy_gb_s']:.1f} GB/s, {ipc['bytes_per_write'] / 2**20:.2f} MiB per write |")
    if "cuda_ipc_scattered" in bench_rows:
        sc = bench_rows["cuda_ipc_scattered"]
        print(f"| bench cuda_ipc, scattered blocks | {sc['ratio']:.2f}x the copy ceiling | | {sc['ipc_gb_s']:.1f} vs "
              f"{sc['copy_gb_s']:.1f} GB/s, {sc['writes']} writes of {sc['bytes_per_write'] / 2**10:.0f} KiB; a round "
              f"trip between the processes {sc['round_trip_us']:.0f} us |")
    for k in bench_rows.get("copy_kernel", []):
        print(f"| bench copy_ranges block {k['block']} x {k['max_programs']}, {k['num_warps']} warps | "
              f"{k['ratio']:.2f}x the copy | | {k['kernel_gb_s']:.1f} vs {k['copy_gb_s']:.1f} GB/s, {k['ranges']} ranges |")
    for ipc in bench_rows.get("cuda_ipc_in_flight", []):
        print(f"| bench cuda_ipc, {ipc['in_flight']} in flight | {ipc['ratio']:.2f}x the copy ceiling | | "
              f"{ipc['ipc_gb_s']:.1f} vs {ipc['copy_gb_s']:.1f} GB/s, {ipc['bytes_per_write'] / 2**20:.2f} MiB per write |")
    (out / "gpucheck.json").write_text(json.dumps({"versions": versions.stdout.strip(), "steps": steps, "tests": tests,
                                                         "bench": bench_rows}, indent=1))
    failed = [t for t in tests if t["outcome"] in ("failed", "error")]
    return 0 if tests and not failed and all(s["rc"] == 0 for s in steps) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.gpucheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "run"])
    ap.add_argument("--dir", default=str(ROOT / ".gpucheck"), help="the carried folder")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpucheck-out"), help="run: where results go")
    ap.add_argument("--quick", action="store_true", help="run: the bench's smoke sizes")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="run: seconds for everything (the device tool's calls are short; the tier gets about half)")
    ap.add_argument("--workers", type=int, default=4, help="run: pytest-xdist workers for the tier, where installed")
    ap.add_argument("--bench-args", default="", help="run: more arguments for bench.gpu (e.g. \"--weights bf16\")")
    args = ap.parse_args(argv)
    if args.what == "prepare":
        prepare(Path(args.dir))
        return 0
    return run(Path(args.dir), Path(args.out), args.quick, args.budget_s, args.workers, args.bench_args.split())


if __name__ == "__main__":
    sys.exit(main())
