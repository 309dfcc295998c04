"""``python -m loadtest.versions``: two builds of pdserve side by side, same workload, same run.

For each concurrency (default 32 and 128) and each build in turn (``--base`` then ``--new``, so a
drift of the machine hits both alike), it starts ``pdserve up`` with that build's command (1
prefill + 1 decode, each pinned to its own CPU), warms it up, and sends the same seeded closed-loop
workload (``--num-prompts`` random prompts of ``--input-len`` tokens +- ``--range-ratio``,
``--output-len`` tokens each with ``ignore_eos``, ``max_concurrency`` requests in flight). It prints
aggregate output tokens/s, request throughput, failures, TTFT and TPOT p50 per build and the
new/base ratio, and writes every run's full result to one JSON file.

A build is a command that runs pdserve, e.g. the checkout of another commit on ``PYTHONPATH``::

    git worktree add /tmp/pdserve-base 23bba26
    python -m loadtest.versions \\
        --base "env PYTHONPATH=/tmp/pdserve-base .venv/bin/python -m deploy.cli" \\
        --new ".venv/bin/pdserve"

This package imports no project code: pdserve runs in subprocesses only.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from loadtest.compare import Server
from loadtest.config import BenchmarkConfig
from loadtest.datasets import random_requests
from loadtest.errors import LoadTestError
from loadtest.report import write_json
from loadtest.runner import run_benchmark


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.versions", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="command that runs the base build's pdserve")
    p.add_argument("--new", required=True, help="command that runs the new build's pdserve")
    p.add_argument("--concurrency", default="32,128", help="comma-separated max_concurrency values")
    p.add_argument("--num-prompts", default="96,256", help="prompts per concurrency (comma-separated)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--cpus", default="0,1")
    p.add_argument("--up-args", default="", help="extra `pdserve up` flags for both builds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-duration", type=float, default=900.0, help="per run, s")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--result-dir", default="results")
    return p


def run_build(command: str, args, concurrency: int, num_prompts: int) -> dict:
    up = ["--prefill", "1", "--decode", "1", "--cpu-affinity", args.cpus, *shlex.split(args.up_args)]
    server = Server(shlex.split(command), up, args.startup_timeout)
    workload = [replace(r, expected_output_len=args.output_len)   # fixed output length
                for r in random_requests(num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)]
    warmup = random_requests(4, args.input_len, 8, 0.0, args.seed + 100)
    print(f"[c={concurrency}] {shlex.join(server.argv)}", flush=True)
    with server as url:
        base = dict(base_url=url, model="SmolLM2-135M-Instruct", ignore_eos=True, max_duration_s=args.max_duration)
        run_benchmark(BenchmarkConfig(**base, num_prompts=len(warmup), max_concurrency=2, progress=False), warmup)
        result = run_benchmark(BenchmarkConfig(**base, num_prompts=num_prompts, max_concurrency=concurrency,
                                               seed=args.seed, progress=False), workload)
    return {"command": server.argv, "result": result}


def table(runs: dict[int, dict[str, dict]]) -> list[str]:
    lines = ["| concurrency | build | ok / failed | output tok/s | req/s | TTFT p50 (ms) | TPOT p50 (ms) | new/base tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for c, builds in runs.items():
        base = builds["base"]["result"]["output_throughput"]
        for name, run in builds.items():
            r = run["result"]
            ratio = f"{r['output_throughput'] / base:.2f}" if name == "new" and base else ""
            lines.append(f"| {c} | {name} | {r['completed']} / {r['failed']} | {r['output_throughput']:.1f} | "
                         f"{r['request_throughput']:.3f} | {r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = [int(x) for x in args.num_prompts.split(",")]
    if len(prompts) != len(levels):
        print("error: --num-prompts needs one value per --concurrency value", file=sys.stderr)
        return 2
    runs: dict[int, dict[str, dict]] = {}
    try:
        for c, n in zip(levels, prompts):
            runs[c] = {name: run_build(cmd, args, c, n) for name, cmd in (("base", args.base), ("new", args.new))}
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    lines = table(runs)
    print("\n".join(lines))
    record = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "argv": sys.argv, "settings": vars(args),
              "table": lines, "runs": {str(c): r for c, r in runs.items()}}
    path = write_json(record, Path(args.result_dir) / f"versions-{record['date']}.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
