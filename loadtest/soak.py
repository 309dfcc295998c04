"""``python -m loadtest.soak``: does every pdserve process's memory stay flat over a long run?

Lifecycle:

1. Start ``pdserve up`` (a subprocess, `loadtest.compare.Server`: this package imports no project
   code) with ``--up-args`` on free ports, and warm it up (4 short requests, not measured).
2. Run the workload closed-loop for ``--duration-s`` seconds: ``--concurrency`` requests always in
   flight, each sent as soon as the previous one of its slot ends. The workload is the harness's
   random dataset on the chat endpoint: prompts of ``--input-len`` words +- ``--range-ratio``,
   exactly ``--output-len`` tokens each (``ignore_eos``), drawn in blocks of ``BLOCK`` prompts
   seeded ``--seed``, ``--seed + 1``, ... (block 0 is `loadtest.versions`' workload). Requests
   still running at the end are cancelled and not counted.
3. Every ``--sample-s`` seconds (and once at t = 0, before the load), read ``VmRSS`` and
   ``VmHWM`` from ``/proc/PID/status`` of each child of the ``pdserve up`` process (router,
   every worker, named from their command lines) and the requests completed so far.
4. Stop the server (SIGINT), print the table (time, RSS per process, MB) and the verdict, write
   ``<result-dir>/soak-<date>.json`` (settings, command, samples, verdict).

Verdict (`verdict`), per process: warm RSS = the first sample at t >= ``--warm-s``; drift = max
over samples at t >= ``--warm-s`` of ``|RSS(t) - RSS(warm)| / RSS(warm)``; the process passes when
drift <= ``--tolerance`` (default 5%). The run passes when every process does; a run with no sample
past ``--warm-s`` has no verdict (exit code 1, as for a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Iterator

from loadtest.client import RequestOutput, build_payload, send_request
from loadtest.compare import Server, _pdserve_command
from loadtest.config import BenchmarkConfig
from loadtest.datasets import random_requests
from loadtest.errors import LoadTestError
from loadtest.report import write_json
from loadtest.runner import make_client, run_benchmark
from loadtest.sample import SampleRequest

BLOCK = 256
"""Prompts drawn per seed (the workload is an endless sequence of such blocks)."""
MODEL = "SmolLM2-135M-Instruct"
KB = 1024


# -- memory of the processes ----------------------------------------------------------------------

def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in bytes (empty when the process is gone)."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * KB
    return out


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (a scan of /proc: the workers run in their own sessions)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)


def process_name(argv: list[str]) -> str:
    """``router``, or the worker's ``--worker-id`` (e.g. ``prefill-0``), or the module run."""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else Path(argv[0]).name if argv else "?"
    if "--worker-id" in argv[:-1]:
        return argv[argv.index("--worker-id") + 1]
    return module


def discover(parent: int) -> dict[str, int]:
    """name -> pid of every child of ``parent``."""
    named = {}
    for pid in children(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        named[process_name([a for a in argv if a])] = pid
    return named


@dataclass
class Sample:
    """One reading: seconds since the load started, requests done, bytes per process."""

    t: float
    completed: int
    rss: dict[str, int]
    hwm: dict[str, int]


class Sampler:
    """A thread reading every process's memory each ``period_s`` until ``close``."""

    def __init__(self, pids: dict[str, int], period_s: float, origin: float, done: "Counter"):
        self.pids, self.period_s, self.origin, self.done = pids, period_s, origin, done
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def read(self) -> Sample:
        rss, hwm = {}, {}
        for name, pid in self.pids.items():
            status = proc_status(pid)
            if status:
                rss[name], hwm[name] = status["VmRSS"], status["VmHWM"]
        return Sample(round(time.monotonic() - self.origin, 1), self.done.ok, rss, hwm)

    def _loop(self) -> None:
        n = 0
        while True:
            sample = self.read()
            self.samples.append(sample)
            print(format_row(sample, list(self.pids)), flush=True)
            n += 1
            if self._stop.wait(max(0.0, self.origin + n * self.period_s - time.monotonic())):
                return

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# -- verdict ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProcessVerdict:
    """One process's drift after warm-up: ``warm_rss`` at ``warm_t``, ``drift`` a fraction."""

    name: str
    warm_t: float
    warm_rss: int
    drift: float
    worst_t: float
    passed: bool


def verdict(samples: list[Sample], warm_s: float, tolerance: float) -> dict[str, ProcessVerdict]:
    """Per process (every name seen after ``warm_s``): the first sample at t >= ``warm_s`` is the
    reference; drift = max |RSS(t) - ref| / ref over samples at t >= ``warm_s``; passed when drift
    <= ``tolerance``. A process missing from a later sample (it died) fails with drift inf.
    Processes never sampled after ``warm_s`` are left out (no verdict)."""
    late = [s for s in samples if s.t >= warm_s]
    out = {}
    names = dict.fromkeys(n for s in late for n in s.rss)
    for name in names:
        first = next(s for s in late if name in s.rss)
        ref = first.rss[name]
        drift, worst_t = 0.0, first.t
        for s in late[late.index(first):]:
            d = abs(s.rss[name] - ref) / ref if name in s.rss else float("inf")
            if d > drift:
                drift, worst_t = d, s.t
        out[name] = ProcessVerdict(name, first.t, ref, drift, worst_t, drift <= tolerance)
    return out


def passed(verdicts: dict[str, ProcessVerdict]) -> bool | None:
    """True when every process passed, None when there is nothing to judge."""
    return all(v.passed for v in verdicts.values()) if verdicts else None


# -- the load ---------------------------------------------------------------------------------------

def workload(input_len: int, output_len: int, range_ratio: float, seed: int) -> Iterator[SampleRequest]:
    """The endless workload of the module docstring (step 2)."""
    for block in itertools.count():
        for r in random_requests(BLOCK, input_len, output_len, range_ratio, seed + block):
            yield replace(r, expected_output_len=output_len)


@dataclass
class Counter:
    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def closed_loop(config: BenchmarkConfig, requests: Iterator[SampleRequest], duration_s: float,
                      done: Counter) -> None:
    """``config.max_concurrency`` slots, each sending its next request when the last one ends,
    until ``duration_s`` has passed; the unfinished ones are cancelled and not counted."""
    deadline = time.monotonic() + duration_s

    async def slot(client) -> None:
        while (remaining := deadline - time.monotonic()) > 0:
            sample = next(requests)
            output = RequestOutput(prompt_len=sample.prompt_len)
            try:
                await asyncio.wait_for(send_request(client, config.url, build_payload(config, sample),
                                                    output), remaining)
            except asyncio.TimeoutError:
                return
            if output.success:
                done.ok += 1
                done.output_tokens += output.output_tokens
            else:
                done.failed += 1
                if len(done.errors) < 20:
                    done.errors.append(output.error)

    async with make_client(config) as client:
        await asyncio.gather(*(slot(client) for _ in range(config.max_concurrency)))


# -- report -----------------------------------------------------------------------------------------

def format_row(sample: Sample, names: list[str]) -> str:
    cells = "".join(f"{sample.rss[n] / 1e6:>14.0f}" if n in sample.rss else f"{'-':>14}" for n in names)
    return f"{sample.t:>8.0f}{sample.completed:>10}{cells}"


def header(names: list[str]) -> str:
    return f"{'t (s)':>8}{'requests':>10}" + "".join(f"{n + ' MB':>14}" for n in names)


def verdict_lines(verdicts: dict[str, ProcessVerdict], tolerance: float) -> list[str]:
    lines = [f"{'process':<12}{'warm t (s)':>12}{'warm MB':>10}{'drift':>9}{'worst t':>9}  verdict"]
    for v in verdicts.values():
        lines.append(f"{v.name:<12}{v.warm_t:>12.0f}{v.warm_rss / 1e6:>10.0f}{100 * v.drift:>8.1f}%"
                     f"{v.worst_t:>9.0f}  {'pass' if v.passed else 'FAIL'}")
    ok = passed(verdicts)
    lines.append("no sample after the warm-up: no verdict" if ok is None else
                 f"{'PASS' if ok else 'FAIL'}: every process within {100 * tolerance:.0f}% of its warm RSS"
                 if ok else f"FAIL: some process drifted more than {100 * tolerance:.0f}%")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.splitlines()[0])
    p.add_argument("--pdserve", help="command that runs pdserve (default: pdserve next to python)")
    p.add_argument("--up-args", default="--weights native --prefix-caching",
                   help="`pdserve up` flags besides the ports")
    p.add_argument("--duration-s", type=float, default=3600.0, help="load duration")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between memory samples")
    p.add_argument("--warm-s", type=float, default=600.0, help="the reference sample's time")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed drift after --warm-s")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--result-dir", default="results")
    return p


def soak(args, pdserve: list[str]) -> dict:
    """Steps 1-4 of the module docstring; the record written to JSON."""
    server = Server(pdserve, shlex.split(args.up_args), args.startup_timeout)
    print(shlex.join(server.argv), flush=True)
    done = Counter()
    with server as url:
        config = BenchmarkConfig(base_url=url, model=MODEL, endpoint="/v1/chat/completions",
                                 ignore_eos=True, max_concurrency=args.concurrency, progress=False,
                                 max_duration_s=args.duration_s + 60, num_prompts=4)
        run_benchmark(config, random_requests(4, args.input_len, 8, 0.0, args.seed + 100))
        pids = discover(server.proc.pid)
        print(header(list(pids)), flush=True)
        sampler = Sampler(pids, args.sample_s, time.monotonic(), done).start()
        try:
            asyncio.run(closed_loop(config, workload(args.input_len, args.output_len, args.range_ratio,
                                                     args.seed), args.duration_s, done))
        finally:
            sampler.close()
        last = sampler.read()
        if last.t > sampler.samples[-1].t:
            sampler.samples.append(last)
    verdicts = verdict(sampler.samples, args.warm_s, args.tolerance)
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "argv": sys.argv, "settings": vars(args),
            "command": server.argv, "pids": pids, "requests": vars(done),
            "samples": [vars(s) for s in sampler.samples],
            "verdict": {n: vars(v) for n, v in verdicts.items()}, "passed": passed(verdicts)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sample_s <= 0 or args.duration_s <= 0 or args.concurrency < 1:
        print("error: --sample-s, --duration-s and --concurrency must be positive", file=sys.stderr)
        return 2
    try:
        record = soak(args, _pdserve_command(args.pdserve))
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    names = list(record["pids"])
    samples = [Sample(**s) for s in record["samples"]]
    print(header(names))
    print("\n".join(format_row(s, names) for s in samples))
    r = record["requests"]
    print(f"requests ok {r['ok']}, failed {r['failed']}, output tokens {r['output_tokens']}")
    verdicts = verdict(samples, args.warm_s, args.tolerance)
    print("\n".join(verdict_lines(verdicts, args.tolerance)))
    path = write_json(record, Path(args.result_dir) / f"soak-{record['date']}.json")
    print(f"wrote {path}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
