"""``python -m loadtest.budget``: where each output token's CPU time goes, measured with py-spy.

Lifecycle: start ``pdserve up`` (1 prefill + 1 decode, ``--up-args``, each worker pinned to its
own CPU) and warm it up; then, for each ``--concurrency`` level, attach ``py-spy record`` (raw
collapsed stacks, ``--rate`` samples/s, active threads only, the process never paused) to the
router, the prefill worker and the decode worker while the same seeded workload as
`loadtest.versions` runs, and stop it. Every sample is put in one bucket by the innermost frame
of this project it passes through (rules in `BUCKETS`, first match wins), and a bucket's cost is
``samples / rate / output_tokens`` -- CPU milliseconds per generated token -- so a regression in
the served path (a slower engine step, more bookkeeping per token, a costlier SSE chunk) shows as
a bigger number in one row.

Buckets, per process:
- decode: ``engine step`` (the forward pass and sampling), ``worker bookkeeping`` (the decode
  loop around the step: admission, outputs to their streams), ``gRPC`` (serializing and sending
  the token stream, control RPCs), ``kv receive`` (the data plane), ``other``;
- prefill: ``engine step``, ``kv send``, ``gRPC``, ``worker bookkeeping``, ``other``;
- router: ``detokenize/stop``, ``gRPC``, ``JSON/SSE`` (response objects, serialization),
  ``HTTP`` (uvicorn/h11/starlette), ``tokenize`` (prompts, chat template), ``routing``
  (orchestration, membership, admission), ``other``.

Prints one table (ms per output token, by process and bucket, one column per concurrency) and
writes it with the raw sample counts to ``--result-dir/budget-<date>.json``. py-spy must be
installed (``pip install py-spy``, in the dev extra) and allowed to ptrace the workers (root, or
``kernel.yama.ptrace_scope=0``).

This package imports no project code: pdserve runs in subprocesses only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from loadtest.compare import Server
from loadtest.config import BenchmarkConfig
from loadtest.datasets import random_requests
from loadtest.errors import LoadTestError
from loadtest.report import write_json
from loadtest.runner import run_benchmark

# (process, bucket, substrings of a frame's "function (file:line)"); the innermost frame that
# matches any rule of the process decides the bucket.
BUCKETS: list[tuple[str, str, tuple[str, ...]]] = [
    ("decode", "engine step", ("engine/models/", "engine/runner.py", "engine/attention.py", "engine/sampling.py",
                               "engine/quant.py", "engine/linear.py", "engine/generator.py")),
    ("decode", "kv receive", ("kvtransfer/",)),
    ("decode", "gRPC", ("grpc/", "rpc/pdserve_pb2", "decode/service.py", "worker/grpc_status.py",
                        "worker/async_sink.py")),
    ("decode", "worker bookkeeping", ("decode/worker.py", "decode/reservation.py", "decode/arrivals.py",
                                      "decode/sink.py", "worker/")),
    ("prefill", "engine step", ("engine/models/", "engine/runner.py", "engine/attention.py", "engine/sampling.py",
                                "engine/quant.py", "engine/linear.py")),
    ("prefill", "kv send", ("kvtransfer/",)),
    ("prefill", "gRPC", ("grpc/", "rpc/pdserve_pb2", "prefill/service.py", "worker/grpc_status.py",
                         "wait_finished")),
    ("prefill", "worker bookkeeping", ("prefill/", "worker/")),
    ("router", "detokenize/stop", ("engine/tokenizer.py", "tokenizers/", "Detokenizer", "detok")),
    ("router", "tokenize", ("apply_chat_template", "jinja2/", "encode (")),
    ("router", "gRPC", ("grpc/", "rpc/pdserve_pb2", "router/clients.py")),
    ("router", "JSON/SSE", ("router/response_bodies.py", "router/protocol.py", "pydantic", "json/")),
    ("router", "HTTP", ("uvicorn/", "h11/", "httptools", "starlette/", "fastapi/", "anyio/")),
    ("router", "routing", ("router/",)),
]
ROLES = ("router", "prefill", "decode")


def classify(stack: str, role: str) -> str:
    """The bucket of one collapsed stack (frames separated by ``;``, outermost first)."""
    rules = [(bucket, needles) for r, bucket, needles in BUCKETS if r == role]
    for frame in reversed(stack.split(";")):
        for bucket, needles in rules:
            if any(n in frame for n in needles):
                return bucket
    return "other"


def parse_raw(path: Path, role: str) -> Counter:
    """Sample counts per bucket from a py-spy ``--format raw`` file (``stack count`` lines)."""
    counts: Counter = Counter()
    if not path.exists():
        return counts
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[classify(stack, role)] += int(n)
    return counts


def worker_pids(root: int) -> dict[str, int]:
    """PIDs of the router and the workers under ``pdserve up`` (by ``python -m <role>``)."""
    found: dict[str, int] = {}
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3:
            children.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2]))
    todo = [root]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            todo.append(pid)
            for role in ROLES:
                if f"-m {role}" in args and role not in found:
                    found[role] = pid
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.budget", description=__doc__.splitlines()[0])
    p.add_argument("--pdserve-cmd", default=".venv/bin/pdserve")
    p.add_argument("--up-args", default="--prefill 1 --decode 1 --weights native")
    p.add_argument("--cpus", default="0,1")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--num-prompts", default="8,96")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")))
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--result-dir", default="results")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = [int(x) for x in args.num_prompts.split(",")]
    if len(levels) != len(prompts):
        print("error: --num-prompts needs one value per --concurrency value", file=sys.stderr)
        return 2
    if not os.access(args.py_spy, os.X_OK):
        print(f"error: py-spy not found at {args.py_spy} (pip install py-spy)", file=sys.stderr)
        return 2
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    up = ["--cpu-affinity", args.cpus, *shlex.split(args.up_args)]
    server = Server(shlex.split(args.pdserve_cmd), up, args.startup_timeout)
    runs: dict[int, dict] = {}
    try:
        with server as url:
            pids = worker_pids(server.proc.pid)
            if set(pids) != set(ROLES):
                raise LoadTestError(f"found {pids} under pdserve up, expected {ROLES}")
            base = dict(base_url=url, model="SmolLM2-135M-Instruct", ignore_eos=True, max_duration_s=900.0)
            warm = random_requests(4, args.input_len, 8, 0.0, args.seed + 100)
            run_benchmark(BenchmarkConfig(**base, num_prompts=4, max_concurrency=2, progress=False), warm)
            for c, n in zip(levels, prompts):
                work = [replace(r, expected_output_len=args.output_len)
                        for r in random_requests(n, args.input_len, args.output_len, args.range_ratio, args.seed)]
                spies = {}
                for role, pid in pids.items():
                    raw = out_dir / f"budget-{date}-c{c}-{role}.txt"
                    spies[role] = (raw, subprocess.Popen(
                        [args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", str(args.rate),
                         "--nonblocking", "--output", str(raw)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                time.sleep(1.0)   # let py-spy attach
                t0 = time.monotonic()
                try:
                    result = run_benchmark(BenchmarkConfig(**base, num_prompts=n, max_concurrency=c, seed=args.seed,
                                                           progress=False), work)
                finally:
                    for _, spy in spies.values():
                        spy.send_signal(2)   # SIGINT: py-spy writes its file and exits
                    for role, (_, spy) in spies.items():
                        try:
                            spy.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            spy.kill()
                wall = time.monotonic() - t0
                tokens = result["total_output_tokens"] or 1
                counts = {role: parse_raw(raw, role) for role, (raw, _) in spies.items()}
                runs[c] = {"completed": result["completed"], "failed": result["failed"], "output_tokens": tokens,
                           "wall_s": wall, "median_tpot_ms": result["median_tpot_ms"],
                           "samples": {r: dict(v) for r, v in counts.items()},
                           "ms_per_token": {r: {b: k / args.rate / tokens * 1000 for b, k in v.items()}
                                            for r, v in counts.items()}}
                print(f"[c={c}] {result['completed']} ok, {result['failed']} failed, {tokens} tokens in {wall:.1f} s",
                      flush=True)
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    lines = [f"| process | bucket | {' | '.join(f'c={c} ms/token' for c in runs)} |",
             "|---|---|" + "---|" * len(runs)]
    for role in ROLES:
        buckets = [b for r, b, _ in BUCKETS if r == role] + ["other"]
        for b in buckets:
            cells = [f"{runs[c]['ms_per_token'][role].get(b, 0.0):.2f}" for c in runs]
            lines.append(f"| {role} | {b} | {' | '.join(cells)} |")
        totals = [f"{sum(runs[c]['ms_per_token'][role].values()):.2f}" for c in runs]
        lines.append(f"| {role} | **total CPU** | {' | '.join(totals)} |")
    tpots = [f"{runs[c]['median_tpot_ms']:.1f}" for c in runs]
    lines.append(f"| client | TPOT p50 (ms) | {' | '.join(tpots)} |")
    print("\n".join(lines))
    record = {"date": date, "argv": sys.argv, "settings": vars(args), "buckets": BUCKETS, "table": lines,
              "runs": {str(c): r for c, r in runs.items()}}
    print(f"wrote {write_json(record, out_dir / f'budget-{date}.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
