"""Writes and bytes of one request's KV between a prefill group of TP a and a decode group of TP b.

    python -m bench.tp_plan [--tokens 1024] [--block-size 16] [--max-write-bytes 4194304]
                            [--engine tcp|shm] [--repeats 5] [--json PATH]

For each model shape (SmolLM2-135M: 30 layers, 3 KV heads of 64; a Llama-3-8B shape: 32 layers,
8 KV heads of 128; both bfloat16) and each (a, b) the shapes split into, the plan
`kvtransfer.tp.head_routes` + `plan_route_writes` makes over the head-major pool (``[L, 2, H, N,
block_size, D]``: one write per (layer, K|V, head, run of blocks)), with the request's blocks
consecutive on both sides (a fresh decode pool's usual case; scattered blocks make every block a
run). Columns:

- ``routes``: (writer rank, reader rank) pairs that carry heads; ``max/reader``: the most writes one
  decode rank counts;
- ``writes`` and ``MiB``: the whole request (the bytes are the readers' heads: replicated decode
  heads are received once per replica);
- modelled, not run: ``HND blocks``: writes with heads inside each block (``[L, 2, N, H,
  block_size, D]``, vLLM's HND layout that its NixlConnector reads head slices of): a route of
  whole pools coalesces runs, a head slice is one write per (layer, K|V, block);
  ``per-token slices``: each (token, layer, K|V) head slice its own write (SGLang's Mooncake
  backend across TP sizes); ``staged``: one write per (layer, route) after a gather into a staging
  buffer (SGLang's fix).

With ``--engine``, each (a, b) is also run: every writer rank and every reader rank is an engine of
its own in this process (its own registered pool, as each rank of a TP worker has:
`worker.tp_rank`), the writer ranks post every layer's writes of their routes at once
(`worker.tp_rank.post_layers`) and the clock stops once every write completed and every reader
rank received its immediates. ``ms`` is the median of ``--repeats`` runs; ``copy ms`` the
reference in the same run, a ``torch`` copy of the same bytes in memory (the ceiling for one
host). All ranks share this process's cores, so the figures compare plans on one machine rather
than predict a cluster's.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import arg_parser, write_json
from kvtransfer import EngineConfig, ImmediateQueue, allocate_shared_buffer, create_engine, pack_immediate
from kvtransfer.group import GroupEndpoint
from kvtransfer.layout import POOL_LAYOUT, KVLayout
from kvtransfer.tp import head_routes, plan_route_writes, rank_heads
from worker.tp_rank import connect_group, post_layers

SHAPES = {"SmolLM2-135M": (30, 3, 64), "Llama-3-8B shape": (32, 8, 128)}   # layers, KV heads, head dim
SIZES = {3: (1, 3), 8: (1, 2, 4, 8, 16)}


def plan_pair(layers: int, kv: int, dim: int, a: int, b: int, tokens: int, block_size: int,
              max_write_bytes: int) -> dict:
    """The plan's figures for one (a, b) (module doc)."""
    blocks = -(-tokens // block_size)
    ids = list(range(blocks))
    per_reader, total_bytes = [0] * b, 0
    routes = head_routes(kv, a, b)
    for r in routes:
        src = KVLayout(layers, blocks, block_size, rank_heads(kv, r.src_rank, a)[1], dim, 2)
        dst = KVLayout(layers, blocks, block_size, rank_heads(kv, r.dst_rank, b)[1], dim, 2)
        plan = plan_route_writes(src, dst, r, ids, ids, max_write_bytes)
        per_reader[r.dst_rank] += len(plan)
        total_bytes += sum(w.length for w in plan)
    return {"a": a, "b": b, "routes": len(routes), "writes": sum(per_reader), "max_per_reader": max(per_reader),
            "bytes": total_bytes, "per_token_slices": len(routes) * layers * 2 * tokens,
            "staged": len(routes) * layers,
            "hnd_blocks": sum(layers * 2 * (1 if r.num_heads == rank_heads(kv, r.src_rank, a)[1]
                                            == rank_heads(kv, r.dst_rank, b)[1] else blocks) for r in routes)}


def time_pair(engine: str, layers: int, kv: int, dim: int, a: int, b: int, tokens: int, block_size: int,
              max_write_bytes: int, repeats: int) -> dict:
    """Run one request's writes from ``a`` writer engines to ``b`` reader engines (module doc);
    ``{"ms": median, "copy_ms": ...}``. Raises KVTransferError when a transfer fails."""
    blocks = -(-tokens // block_size)
    ids = list(range(blocks))
    config = EngineConfig(secret=b"bench-tp-plan-secret-0123456789")
    readers, writers, inboxes, shared, expect = [], [], [], [], [0] * b
    try:
        for d in range(b):
            layout = KVLayout(layers, blocks, block_size, rank_heads(kv, d, b)[1], dim, 2)
            raw, shm = allocate_shared_buffer(layout.total_bytes)
            shared.append(shm)
            inboxes.append(ImmediateQueue())
            readers.append(create_engine(engine, config, arrivals=inboxes[-1]))
            readers[-1].register_memory(raw[:layout.total_bytes], shared=shm)
        group = GroupEndpoint(tuple(rx.describe() for rx in readers), kv, POOL_LAYOUT)
        for r in range(a):
            layout = KVLayout(layers, blocks, block_size, rank_heads(kv, r, a)[1], dim, 2)
            pool = torch.randint(0, 255, (layout.total_bytes,), dtype=torch.uint8)
            tx = create_engine(engine, config)
            region = tx.register_memory(pool)
            writers.append((tx, region, layout, connect_group(tx, group, layout, kv, r, a, "readers"), pool))
        for route in writers[0][3].routes:
            expect[route.dst_rank] += len(plan_route_writes(writers[route.src_rank][2], writers[0][3].layouts[route.dst_rank],
                                                            route, ids, ids, max_write_bytes))
        times, nbytes = [], 0
        for rep in range(repeats + 1):   # the first run warms the connections up
            imm = pack_immediate(1, rep % 2)
            t0 = time.perf_counter()
            handles = []
            for tx, region, layout, peer, _ in writers:
                for layer in range(layers):
                    posted, n = post_layers(tx, region, layout, peer, ids, ids, imm, max_write_bytes, (layer,))
                    handles += [(tx, h) for h in posted]
                    nbytes += n if rep == 0 else 0
            for tx, h in handles:
                tx.wait(h, timeout_s=120)
            for d in range(b):
                for _ in range(expect[d]):
                    inboxes[d].immediates.get(timeout=120)
            if rep:
                times.append(time.perf_counter() - t0)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        copies = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        return {"ms": 1e3 * statistics.median(times), "copy_ms": 1e3 * statistics.median(copies)}
    finally:
        for tx, *_ in writers:
            tx.close()
        for rx in readers:
            rx.close()
        for shm in shared:
            shm.close()


def main(argv=None) -> dict:
    ap = arg_parser("bench.tp_plan", __doc__)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-write-bytes", type=int, default=4 << 20)
    ap.add_argument("--engine", choices=["tcp", "shm"], help="also run each pair over this engine")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    result = {"tokens": args.tokens, "block_size": args.block_size, "engine": args.engine, "shapes": {}}
    timed = " | ms | copy ms" if args.engine else ""
    for name, (layers, kv, dim) in SHAPES.items():
        rows = [plan_pair(layers, kv, dim, a, b, args.tokens, args.block_size, args.max_write_bytes)
                for a in SIZES[kv] for b in SIZES[kv]]
        result["shapes"][name] = rows
        print(f"\n{name}: {layers} layers x {kv} KV heads x {dim}, bfloat16; one request of {args.tokens} tokens"
              + (f"; run over {args.engine}" if args.engine else ""))
        print(f"| prefill TP | decode TP | routes | writes | max/reader | MiB | HND blocks | per-token slices | "
              f"staged{timed} |")
        print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.engine else ""))
        for r in rows:
            if args.engine:
                r.update(time_pair(args.engine, layers, kv, dim, r["a"], r["b"], args.tokens, args.block_size,
                                   args.max_write_bytes, args.repeats))
            cells = f" | {r['ms']:.1f} | {r['copy_ms']:.1f}" if args.engine else ""
            print(f"| {r['a']} | {r['b']} | {r['routes']} | {r['writes']} | {r['max_per_reader']} | "
                  f"{r['bytes'] / 2**20:.1f} | {r['hnd_blocks']} | {r['per_token_slices']} | {r['staged']}{cells} |")
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
