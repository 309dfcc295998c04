"""Forward passes on two torch threads from a worker-like compute thread, with and without a
second OpenMP team alive in the process.

    python -m bench.omp_teams [--weights native] [--reps 7] [--json PATH]

torch's CPU build runs its intra-op parallelism on GNU OpenMP (libgomp). Every thread that runs
a parallel operator becomes the master of a team that lives as long as that thread. libgomp
spins at a team's barriers only while it manages no more threads than the process has CPUs;
past that it waits almost at once (a futex sleep and wake per barrier, its "throttled" spin).
A worker that built its model on the main thread (a team) and computes on its loop thread (a
second team) was past it on two threads. `worker.runtime.run_on_own_thread` builds on a thread
that ends; this benchmark shows what that is worth. Rows, side by side in one run, each on a
fresh compute thread with two torch threads (passes as `bench.threads`: a 256-token prefill
chunk, decode steps of 1, 8 and 32 sequences of 256-token contexts), milliseconds per pass:

- ``alone``: the compute thread's team is the process's only one;
- ``beside a team``: the main thread ran a parallel operator first, so its team is alive too
  (a worker that built its model on its main thread).

Needs at least 2 CPUs. Writes the table's figures to ``--json`` with `bench.common.header`.
"""

from __future__ import annotations

import os
import sys

import torch

from bench.common import arg_parser, write_json
from bench.threads import BS, time_passes
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.runner import ModelRunner
from worker.runtime import run_on_own_thread

ROWS = ("alone", "beside a team")


def main(argv=None) -> dict:
    ap = arg_parser("bench.omp_teams", __doc__)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("error: needs at least 2 CPUs", file=sys.stderr)
        return {}
    torch.set_num_threads(1)   # the main thread makes no team while loading
    loaded = run_on_own_thread("bench-build", load_model, None, args.weights)
    pool = KVPool(loaded.config, CacheConfig(block_size=BS, num_blocks=32 * 20, dtype=loaded.kv_dtype))
    torch.set_num_threads(2)

    def passes():
        return time_passes(ModelRunner(loaded.model, pool), pool, args.reps)

    rows = {"alone": run_on_own_thread("bench-compute", passes)}
    torch.ones(1 << 20).mul_(2)   # a parallel operator on the main thread: its team now lives
    rows["beside a team"] = run_on_own_thread("bench-compute", passes)
    kinds = list(rows["alone"])
    print("| pass | " + " | ".join(ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{rows[r][k] * 1000:.1f}" for r in ROWS) + " |")
    result = {"unit": "ms", "rows": {r: {k: v * 1000 for k, v in rows[r].items()} for r in ROWS}}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
