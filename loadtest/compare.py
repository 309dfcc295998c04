"""``python -m loadtest.compare``: disaggregated against colocated serving on the same CPUs.

Lifecycle, once per deployment (default: ``disaggregated`` then ``colocated``):

1. Start it with ``pdserve up`` (a subprocess: this package imports no project code) on free
   ports, every worker pinned to its own CPU (``--cpu-affinity``), and wait for "pdserve is up".
2. Warm up: one long and one short request per worker, not measured.
3. Run the harness (`loadtest.runner`) with the same seeded mixed workload: ``--long-fraction``
   of the prompts ``--long-len`` tokens, the rest ``--short-len``, outputs uniform in
   ``[--output-min, --output-max]`` (``ignore_eos``), Poisson arrivals at ``--request-rate``.
4. Stop it (SIGINT: the launcher drains and stops every process) before the next one starts.

A fair comparison uses the same cores and the same number of worker processes:

    disaggregated   1 prefill (CPU 0) + 1 decode (CPU 1), KV moved prefill -> decode
    colocated       2 decode workers (CPU 0, CPU 1), each prefilling its own requests
    auto            1 prefill (CPU 0) + 1 decode (CPU 1), prompts under --threshold colocated

The router and this client are not pinned; they run on the same CPUs for every deployment.
Prints TTFT / TPOT p50 and p99 (all requests, then short and long prompts apart) and goodput
side by side, and writes everything (each run's full result, vLLM field names) to one JSON file.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from loadtest.cli import parse_goodput
from loadtest.config import BenchmarkConfig
from loadtest.datasets import random_requests
from loadtest.errors import LoadTestError
from loadtest.report import write_json
from loadtest.runner import run_benchmark
from loadtest.sample import SampleRequest


@dataclass(frozen=True)
class Deployment:
    """One way to serve on the CPUs: ``pdserve up`` flags besides ports and pinning."""

    name: str
    up_args: tuple[str, ...]
    workers: int


def deployments(threshold: int) -> dict[str, Deployment]:
    """The deployments this script knows, by name (see the module docstring)."""
    return {
        "disaggregated": Deployment("disaggregated", ("--prefill", "1", "--decode", "1",
                                                      "--serving-mode", "disaggregated"), 2),
        "colocated": Deployment("colocated", ("--prefill", "0", "--decode", "2",
                                              "--serving-mode", "colocated"), 2),
        "auto": Deployment("auto", ("--prefill", "1", "--decode", "1", "--serving-mode", "auto",
                                    "--colocated-threshold-tokens", str(threshold)), 2),
    }


def mixed_requests(num: int, long_len: int, short_len: int, long_fraction: float,
                   output_min: int, output_max: int, seed: int) -> list[SampleRequest]:
    """``num`` random-word prompts, ``round(num * long_fraction)`` of ``long_len`` tokens and the
    rest of ``short_len``, in a seeded random order; ``max_tokens`` uniform in
    ``[output_min, output_max]``."""
    rng = np.random.default_rng(seed)
    n_long = round(num * long_fraction)
    prompts = (random_requests(n_long, long_len, 1, 0.0, seed)
               + random_requests(num - n_long, short_len, 1, 0.0, seed + 1))
    outputs = rng.integers(output_min, output_max + 1, size=num).tolist()
    order = rng.permutation(num).tolist()
    return [replace(prompts[i], expected_output_len=out) for i, out in zip(order, outputs)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``pdserve up`` in a subprocess; ``with Server(...) as url:`` starts, waits, stops."""

    def __init__(self, pdserve: list[str], args: list[str], startup_timeout_s: float):
        self.http_port = _free_port()
        self.argv = pdserve + ["up", "--http-port", str(self.http_port),
                               "--registry-port", str(_free_port()), *args]
        self.startup_timeout_s = startup_timeout_s
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), name="pdserve-up-output",
                         daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line and "pdserve is up" in line:
                return f"http://127.0.0.1:{self.http_port}"
            if line is None or time.monotonic() > deadline:
                self.__exit__()
                tail = "".join(self.lines[-30:])
                raise LoadTestError(f"{shlex.join(self.argv)} did not come up:\n{tail}")

    def _pump(self, lines: queue.Queue) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            lines.put(line)
        lines.put(None)

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def class_stats(result: dict, split_len: int) -> dict[str, dict[str, float]]:
    """TTFT / TPOT p50 and p99 (ms) of successful requests with prompts shorter than
    ``split_len`` tokens ("short") and the others ("long")."""
    out = {}
    rows = [(i, t, lat, o) for i, t, lat, o, e in zip(
        result["input_lens"], result["ttfts"], result["latencies"], result["output_lens"],
        result["errors"]) if not e]
    for name, keep in (("short", lambda n: n < split_len), ("long", lambda n: n >= split_len)):
        sel = [r for r in rows if keep(r[0])]
        ttft = [r[1] * 1000 for r in sel]
        tpot = [(r[2] - r[1]) / (r[3] - 1) * 1000 for r in sel if r[3] > 1]
        out[name] = {"count": len(sel)}
        for metric, values in (("ttft", ttft), ("tpot", tpot)):
            for p in (50, 99):
                out[name][f"p{p}_{metric}_ms"] = float(np.percentile(values, p)) if values else math.nan
    return out


def table(runs: dict[str, dict]) -> list[str]:
    """The side-by-side table, one string per line."""
    names = list(runs)
    rows = [("requests ok / failed", lambda r, c: f"{r['completed']} / {r['failed']}")]
    for metric in ("ttft", "tpot"):
        for p in ("median", "p99"):
            key = f"{p}_{metric}_ms"
            rows.append((f"{metric.upper()} {'p50' if p == 'median' else p} (ms)",
                         lambda r, c, key=key: f"{r[key]:.0f}"))
    for cls in ("short", "long"):
        for metric in ("ttft", "tpot"):
            rows.append((f"  {cls} prompts {metric.upper()} p50 / p99",
                         lambda r, c, cls=cls, m=metric: f"{c[cls][f'p50_{m}_ms']:.0f} / "
                                                         f"{c[cls][f'p99_{m}_ms']:.0f}"))
    rows += [("goodput (req/s)", lambda r, c: f"{r['request_goodput']:.3f}"),
             ("requests within SLOs", lambda r, c: f"{100 * r['goodput_ratio']:.0f}%"),
             ("request throughput (req/s)", lambda r, c: f"{r['request_throughput']:.3f}"),
             ("output throughput (tok/s)", lambda r, c: f"{r['output_throughput']:.1f}")]
    width = max(16, *(len(n) for n in names))
    lines = [f"{'':<36}" + "".join(f"{n:>{width + 2}}" for n in names)]
    for label, fn in rows:
        lines.append(f"{label:<36}" + "".join(
            f"{fn(runs[n]['result'], runs[n]['by_class']):>{width + 2}}" for n in names))
    return lines


def _pdserve_command(text: str | None) -> list[str]:
    if text:
        return shlex.split(text)
    found = shutil.which("pdserve") or str(Path(sys.executable).with_name("pdserve"))
    return [found]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__.splitlines()[0])
    p.add_argument("--deployments", default="disaggregated,colocated",
                   help="comma-separated among disaggregated, colocated, auto")
    p.add_argument("--cpus", default="0,1", help="CPUs to pin the two workers to")
    p.add_argument("--threshold", type=int, default=256, help="auto: colocated below (tokens)")
    p.add_argument("--pdserve", help="command that runs pdserve (default: pdserve next to python)")
    p.add_argument("--up-args", default="", help="extra `pdserve up` flags, e.g. '--num-blocks 1024'")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--long-len", type=int, default=1024, help="long prompt, tokens (approx.)")
    p.add_argument("--short-len", type=int, default=64, help="short prompt, tokens (approx.)")
    p.add_argument("--long-fraction", type=float, default=0.5)
    p.add_argument("--output-min", type=int, default=64)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals, req/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=["ttft:3000", "tpot:75"], metavar="NAME:MS")
    p.add_argument("--max-duration", type=float, default=300.0, help="per run, s")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="per deployment, s")
    p.add_argument("--result-dir", default="results", help="where the JSON goes")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def run_one(dep: Deployment, args, pdserve: list[str], workload: list[SampleRequest],
            warmup: list[SampleRequest]) -> dict:
    """Start ``dep``, warm it up, run the workload, stop it; the run's record."""
    up = [*dep.up_args, "--cpu-affinity", args.cpus, *shlex.split(args.up_args)]
    server = Server(pdserve, up, args.startup_timeout)
    print(f"[{dep.name}] {shlex.join(server.argv)}", flush=True)
    with server as url:
        base = dict(base_url=url, model="SmolLM2-135M-Instruct", label=dep.name, ignore_eos=True,
                    max_duration_s=args.max_duration)
        run_benchmark(BenchmarkConfig(**base, num_prompts=len(warmup), progress=False,
                                      max_concurrency=dep.workers), warmup)
        config = BenchmarkConfig(**base, num_prompts=len(workload), request_rate=args.request_rate,
                                 seed=args.seed, goodput_slos_ms=parse_goodput(args.goodput),
                                 progress=not args.disable_tqdm)
        result = run_benchmark(config, workload)
    split = (args.long_len + args.short_len) // 2
    return {"command": server.argv, "result": result, "by_class": class_stats(result, split)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    known = deployments(args.threshold)
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        print(f"error: unknown deployments {unknown}; choose among {list(known)}", file=sys.stderr)
        return 2
    workload = mixed_requests(args.num_prompts, args.long_len, args.short_len, args.long_fraction,
                              args.output_min, args.output_max, args.seed)
    warmup = mixed_requests(4, args.long_len, args.short_len, 0.5, 8, 8, args.seed + 100)
    pdserve = _pdserve_command(args.pdserve)
    runs = {}
    try:
        for name in names:
            runs[name] = run_one(known[name], args, pdserve, workload, warmup)
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    lines = table(runs)
    print("\n".join(lines))
    record = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "argv": sys.argv,
              "settings": vars(args), "table": lines, "runs": runs}
    path = write_json(record, Path(args.result_dir) / f"compare-{record['date']}.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
