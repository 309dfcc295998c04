"""Writes and bytes of one request's KV between a prefill group of TP a and a decode group of TP b.

    python -m bench.tp_plan [--tokens 1024] [--block-size 16] [--max-write-bytes 4194304] [--json PATH]

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

Nothing is timed: the transfer's time needs TP workers on both sides (not built yet).
"""

from __future__ import annotations

from bench.common import arg_parser, write_json
from kvtransfer.layout import KVLayout
from kvtransfer.tp import head_routes, plan_route_writes, rank_heads

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


def main(argv=None) -> dict:
    ap = arg_parser("bench.tp_plan", __doc__)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-write-bytes", type=int, default=4 << 20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    result = {"tokens": args.tokens, "block_size": args.block_size, "shapes": {}}
    for name, (layers, kv, dim) in SHAPES.items():
        rows = [plan_pair(layers, kv, dim, a, b, args.tokens, args.block_size, args.max_write_bytes)
                for a in SIZES[kv] for b in SIZES[kv]]
        result["shapes"][name] = rows
        print(f"\n{name}: {layers} layers x {kv} KV heads x {dim}, bfloat16; one request of {args.tokens} tokens")
        print("| prefill TP | decode TP | routes | writes | max/reader | MiB | HND blocks | per-token slices | "
              "staged |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['a']} | {r['b']} | {r['routes']} | {r['writes']} | {r['max_per_reader']} | "
                  f"{r['bytes'] / 2**20:.1f} | {r['hnd_blocks']} | {r['per_token_slices']} | {r['staged']} |")
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
