"""One server's turn in `loadtest.peers`: start it, warm it up, measure it at every concurrency
level with the same seeded workload, stop it (always, even on Ctrl-C). Errors come back as
messages (with the server's last output lines), never as exceptions, so the next server runs."""

from __future__ import annotations

from dataclasses import replace

from loadtest.cli import first_model
from loadtest.config import BenchmarkConfig
from loadtest.datasets import random_requests
from loadtest.errors import LoadTestError
from loadtest.peer_servers import PDSERVE, PDSERVE_MODEL
from loadtest.runner import run_benchmark


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
