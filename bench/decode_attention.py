"""One layer's decode attention on the CPU: the serving path against the pool read through the
block table by a compiled kernel.

    python -m bench.decode_attention [--threads 1] [--reps 15] [--batches 1,8,32]
                                     [--contexts 256,1024] [--spread S] [--json PATH]

Per batch size and context (every sequence ``context`` tokens but every third one a quarter
shorter, so the rows are ragged; with ``--spread S``, each sequence's context drawn uniformly
from ``context * (1 - S) .. context * (1 + S)``, as a served batch's are), one layer of
SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16 tokens, a bfloat16
pool stored head-major as `engine.kv_cache.KVPool` holds it, float32 queries, tables scattered
over the pool), median milliseconds of:

- ``grouped``: `engine.attention.paged_attention` as a decode step calls it on the CPU
  (`_decode_attention`: per `DecodeGroup`, K/V gathered, cast and attended by SDPA);
- ``indexed, compiled``: `engine.paged_decode.CompiledDecode`, `paged_decode_indexed` compiled
  ahead of time by AOTInductor, the batch size and the table width dynamic; one package per pool
  shape (each row's pool has its own size), loaded from the disk cache or built at its first call;
  the first call's seconds are reported apart. Its rows go through the package in groups of
  similar context (`engine.paged_decode.length_groups`) where that saves padding;
- ``one call``: the same package called once over the whole table (every row as wide as the
  longest), the kernel before those groups.

Each row also gives the largest absolute difference between the two outputs. Prints a table and,
with ``--json``, writes it.
"""

from __future__ import annotations

import time

import torch

from bench.common import arg_parser, median_time, write_json
from engine.attention import ForwardBatch, SeqChunk, paged_attention
from engine.paged_decode import CompiledDecode

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def cases(batch: int, context: int, gen: torch.Generator, spread: float | None = None) -> tuple:
    """``(q, k_pool, v_pool, batch, tables, lens)`` for one row of the table (module docstring);
    ``batch`` a decode `ForwardBatch` over the same tables."""
    if spread is None:
        lens = [context - (context // 4 if i % 3 == 2 else 0) for i in range(batch)]
    else:
        lo, hi = max(1, round(context * (1 - spread))), round(context * (1 + spread))
        lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    per_seq = -(-max(lens) // BLOCK)
    num_blocks = batch * per_seq + 1
    # stored head-major, as `engine.kv_cache.KVPool` holds it; the layer's view is the transpose
    k_pool = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).bfloat16().transpose(0, 1)
    v_pool = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).bfloat16().transpose(0, 1)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = [order[i * per_seq:i * per_seq + -(-n // BLOCK)] for i, n in enumerate(lens)]
    fb = ForwardBatch.build([SeqChunk([1], n - 1, t) for n, t in zip(lens, tables)], BLOCK)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return q, k_pool, v_pool, fb, fb.block_tables, torch.tensor(lens)


def _one_call(kernel: CompiledDecode, q, k_pool, v_pool, fb: ForwardBatch):
    """The kernel's package called once over ``fb``'s whole table (no length groups)."""
    package = kernel.package(q, k_pool, v_pool, None, None, None)
    tables, lens = fb.indexed_decode_inputs()
    q = q.contiguous()
    return lambda: package(q, k_pool, v_pool, tables, lens)


def main(argv=None) -> dict:
    ap = arg_parser("bench.decode_attention", __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--spread", type=float, default=None,
                    help="contexts drawn from context * (1 -+ SPREAD) (default: every third a quarter shorter)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = CompiledDecode(min_rows=1)
    gen = torch.Generator().manual_seed(0)
    rows, first_call_s = [], None
    for context in (int(c) for c in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            q, k_pool, v_pool, fb, tables, lens = cases(b, context, gen, args.spread)
            grouped = paged_attention(q, None, None, k_pool, v_pool, fb, BLOCK)
            t0 = time.perf_counter()
            indexed = kernel(q, k_pool, v_pool, fb, None, None, None)
            if first_call_s is None:
                first_call_s = time.perf_counter() - t0
            row = {"batch": b, "context": context,
                   "grouped_s": median_time(lambda: paged_attention(q, None, None, k_pool, v_pool, fb, BLOCK),
                                            args.reps),
                   "indexed_compiled_s": median_time(lambda: kernel(q, k_pool, v_pool, fb, None, None, None),
                                                     args.reps),
                   "one_call_s": median_time(_one_call(kernel, q, k_pool, v_pool, fb), args.reps),
                   "max_abs_diff": float((grouped - indexed).abs().max())}
            rows.append(row)
            print(f"batch {b} context {context}: grouped {row['grouped_s'] * 1e3:.3f} ms, "
                  f"indexed compiled {row['indexed_compiled_s'] * 1e3:.3f} ms, "
                  f"one call {row['one_call_s'] * 1e3:.3f} ms", flush=True)
    print(f"first compiled call {first_call_s:.1f} s; {args.threads} thread(s); torch {torch.__version__}")
    print("| batch | context | grouped ms | indexed, compiled ms | speed-up | one call ms | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['grouped_s'] * 1e3:.3f} | {r['indexed_compiled_s'] * 1e3:.3f} "
              f"| {r['grouped_s'] / r['indexed_compiled_s']:.2f}x | {r['one_call_s'] * 1e3:.3f} "
              f"| {r['max_abs_diff']:.1e} |")
    result = {"threads": args.threads, "reps": args.reps, "spread": args.spread, "first_compiled_call_s": first_call_s,
              "rows": rows}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
