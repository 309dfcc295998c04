"""One layer's prompt attention on the CPU: torch's flash SDPA against FlexAttention compiled by
inductor (`engine.flex_prefill.CompiledPrefill`) with the template's own score micro-GEMM and with
the register block of `engine.flex_prefill.QK_REGISTER_BLOCK`.

    python -m bench.prefill_attention [--threads 1] [--reps 30] [--lengths 128,256,512,1024]
                                      [--cached 0] [--json PATH]

Per prompt chunk of ``length`` tokens after ``cached`` tokens of context, SmolLM2-135M's shapes (9
query heads over 3 KV heads, head_dim 64, float32 queries, bfloat16 K/V as a pool holds them),
median milliseconds of:

- ``sdpa``: torch's flash SDPA as `engine.attention.paged_attention` calls it without the kernel
  (float32 K/V, grouped-query heads): causal for a fresh chunk; after cached context, the context
  unmasked and the chunk causal, merged (`engine.attention.causal_after_context`);
- ``sdpa, masked`` (with ``--cached``): one SDPA call under the explicit ``[n, ctx]`` causal mask,
  the path of chunks after cached context before that merge;
- ``flex, template``: `CompiledPrefill` built with inductor's FlexAttention template as it is, its
  score micro-GEMM (Q K^T) one query row by 16 keys;
- ``flex``: `CompiledPrefill` as a worker builds it, the score micro-GEMM with the register block
  of `QK_REGISTER_BLOCK` for the vector width inductor writes for.

Each row also gives the largest absolute difference of each FlexAttention output from SDPA's. Both
packages are built in temporary inductor caches of their own, never the disk cache a worker loads
(its key is the sources, not the register block): the two builds' seconds are reported. Prints a
table and, with ``--json``, writes it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch
import torch.nn.functional as F

import engine.flex_prefill as flex_prefill
from bench.common import arg_parser, median_time, write_json
from engine.attention import causal_after_context
from engine.flex_prefill import CompiledPrefill

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """``q`` ``[n, heads, dim]``, the last ``n`` of ``ctx`` positions, over ``k``, ``v`` ``[ctx,
    kv_heads, dim]`` (float32), causal -> ``[n, heads * dim]``; after cached context as the
    serving path attends (`causal_after_context`), or with ``masked`` as one call under the mask."""
    n, ctx = q.shape[0], k.shape[0]
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    if n == ctx:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    elif masked:
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    else:
        o = causal_after_context(qt, kt, vt, None)
    return o[0].transpose(0, 1).reshape(n, -1)


def build(stack: contextlib.ExitStack, template: bool) -> tuple[CompiledPrefill, float]:
    """A `CompiledPrefill` warmed up (its package built) in a temporary inductor cache kept open by
    ``stack``; ``template``: the score micro-GEMM left at the template's 1 x 16. Returns the kernel
    and the build's seconds."""
    cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-prefill-attention-"))
    saved_env, saved_block = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), flex_prefill.QK_REGISTER_BLOCK
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    if template:
        flex_prefill.QK_REGISTER_BLOCK = {width: (1, 16) for width in saved_block}
    try:
        kernel, t0 = CompiledPrefill(), time.perf_counter()
        kernel.warm_up(HEADS, KV_HEADS, HEAD_DIM, torch.float32)
        return kernel, time.perf_counter() - t0
    finally:
        flex_prefill.QK_REGISTER_BLOCK = saved_block
        if saved_env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_env


def main(argv=None) -> dict:
    ap = arg_parser("bench.prefill_attention", __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--lengths", default="128,256,512,1024")
    ap.add_argument("--cached", type=int, default=0, help="tokens of context before each chunk")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with contextlib.ExitStack() as stack, torch.inference_mode():
        template, template_build_s = build(stack, template=True)
        ours, build_s = build(stack, template=False)
        for n in (int(x) for x in args.lengths.split(",")):
            q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
            k, v = (torch.randn(args.cached + n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
            kf, vf = k.float(), v.float()
            want = sdpa(q, kf, vf)
            masked_s = median_time(lambda: sdpa(q, kf, vf, masked=True), args.reps) if args.cached else None
            row = {"length": n, "cached": args.cached,
                   "sdpa_s": median_time(lambda: sdpa(q, kf, vf), args.reps), "sdpa_masked_s": masked_s,
                   "flex_template_s": median_time(lambda: template(q, k, v), args.reps),
                   "flex_s": median_time(lambda: ours(q, k, v), args.reps),
                   "template_max_abs_diff": float((template(q, k, v) - want).abs().max()),
                   "max_abs_diff": float((ours(q, k, v) - want).abs().max())}
            rows.append(row)
            print(f"length {n}: sdpa {row['sdpa_s'] * 1e3:.3f} ms, flex template {row['flex_template_s'] * 1e3:.3f}"
                  f" ms, flex {row['flex_s'] * 1e3:.3f} ms", flush=True)
    blocks = flex_prefill.QK_REGISTER_BLOCK
    print(f"builds: template {template_build_s:.1f} s, flex {build_s:.1f} s; register blocks {blocks}; "
          f"{args.threads} thread(s); torch {torch.__version__}")
    print("| length | cached | SDPA ms | SDPA, masked ms | flex, template ms | flex ms | flex vs template | "
          "max abs diff (template / flex) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        masked = "-" if r["sdpa_masked_s"] is None else f"{r['sdpa_masked_s'] * 1e3:.3f}"
        print(f"| {r['length']} | {r['cached']} | {r['sdpa_s'] * 1e3:.3f} | {masked} | "
              f"{r['flex_template_s'] * 1e3:.3f} | {r['flex_s'] * 1e3:.3f} | "
              f"{r['flex_template_s'] / r['flex_s']:.2f}x | {r['template_max_abs_diff']:.1e} / {r['max_abs_diff']:.1e} |")
    result = {"threads": args.threads, "reps": args.reps, "register_blocks": {str(w): list(b) for w, b in blocks.items()},
              "template_build_s": template_build_s, "build_s": build_s, "rows": rows}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
