"""What a request's KV writes cost the prefill worker's pass thread, before any byte moves.

    python -m bench.plan_cost [--tokens 256,1024,4096] [--repeats 7] [--json PATH]

The prefill loop counts a job's writes once (the immediates the decode worker will count:
`worker.tp_rank.count_job_writes`) and, as each layer of the pass finishes, plans that layer's
writes and turns them into engine ops (`worker.tp_rank.post_layers`), on the thread that runs the
model. For SmolLM2-135M's pool (30 layers, 3 KV heads of 64, blocks of 16, bfloat16) and a
Llama-3-8B shape (32 layers, 8 KV heads of 128) at TP 1, with the request's blocks consecutive on
both sides (a fresh pool) or scattered (a pool after churn: every block its own run, one write per
block, layer, K|V and head), each row times in one run:

- ``objects``: the count as the length of the whole plan and each layer planned as `PlannedWrite`
  objects (`kvtransfer.tp.plan_route_writes`, then `kvtransfer.to_write_ops`): the path before
  `plan_route_arrays`;
- ``arrays``: `count_route_writes` and each layer as an int64 array (`plan_route_arrays`, then
  `to_write_ops`): what the worker runs.

Milliseconds per request (count plus every layer), best of ``--repeats`` with the garbage
collector run before each.
"""

from __future__ import annotations

import gc
import random
import time

from bench.common import arg_parser, write_json
from kvtransfer import KVLayout, MemoryRegion, to_write_ops
from kvtransfer.tp import count_route_writes, head_routes, plan_route_arrays, plan_route_writes

SHAPES = {"SmolLM2-135M": (30, 3, 64), "Llama-3-8B shape": (32, 8, 128)}   # layers, KV heads, head dim
BLOCK, POOL_BLOCKS, MAX_WRITE = 16, 4096, 4 << 20


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def request_cost(shape: str, tokens: int, scattered: bool, repeats: int) -> dict:
    """One row (module doc): ``objects_ms``, ``arrays_ms`` and the request's ``writes``."""
    layers, kv, dim = SHAPES[shape]
    layout = KVLayout(layers, POOL_BLOCKS, BLOCK, kv, dim, 2)
    route = head_routes(kv, 1, 1)[0]
    region = MemoryRegion(0, layout.total_bytes, 7)
    n = -(-tokens // BLOCK)
    rng = random.Random(tokens)
    src = rng.sample(range(POOL_BLOCKS), n) if scattered else list(range(n))
    dst = rng.sample(range(POOL_BLOCKS), n) if scattered else list(range(100, 100 + n))

    def objects() -> int:
        count = len(plan_route_writes(layout, layout, route, src, dst, MAX_WRITE))
        for layer in range(layers):
            to_write_ops(plan_route_writes(layout, layout, route, src, dst, MAX_WRITE, [layer]), region, 9, 5)
        return count

    def arrays() -> int:
        count = count_route_writes(layout, layout, route, src, dst, MAX_WRITE)
        for layer in range(layers):
            to_write_ops(plan_route_arrays(layout, layout, route, src, dst, MAX_WRITE, [layer]), region, 9, 5)
        return count

    writes = arrays()
    assert writes == objects()
    return {"shape": shape, "tokens": tokens, "blocks": "scattered" if scattered else "consecutive", "writes": writes,
            "objects_ms": _best_ms(objects, repeats), "arrays_ms": _best_ms(arrays, repeats)}


def main(argv=None) -> dict:
    ap = arg_parser("bench.plan_cost", __doc__)
    ap.add_argument("--tokens", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    print("| shape | tokens | blocks | writes | objects ms | arrays ms | ratio |\n|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        for tokens in (int(t) for t in args.tokens.split(",")):
            for scattered in (False, True):
                r = request_cost(shape, tokens, scattered, args.repeats)
                rows.append(r)
                print(f"| {shape} | {tokens} | {r['blocks']} | {r['writes']} | {r['objects_ms']:.2f} | "
                      f"{r['arrays_ms']:.2f} | {r['objects_ms'] / r['arrays_ms']:.1f}x |", flush=True)
    result = {"rows": rows}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
