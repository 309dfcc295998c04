"""The Triton decode kernel's cases, run in a process of their own under ``TRITON_INTERPRET=1``
(Triton decides at import whether its functions are interpreted, and another test may have
imported it first): ``python -m tests.unit.triton_cases OUT`` saves each case's inputs and output
to ``OUT`` (`torch.save`); `tests/unit/test_triton_attention.py` checks them against a reference."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

CASES = {   # name: (heads, kv_heads, head_dim, block, window, softcap, pool dtype)
    "mha": (4, 4, 16, 16, None, None, torch.float32),
    "gqa": (8, 2, 32, 16, None, None, torch.float32),
    "gqa3-dim24-block32": (6, 2, 24, 32, None, None, torch.float32),
    "window": (8, 2, 32, 16, 20, None, torch.float32),
    "softcap": (8, 4, 32, 16, None, 5.0, torch.float32),
    "all-one-kv-head": (8, 1, 16, 16, 7, 3.0, torch.float32),
    "bf16-pool": (4, 2, 16, 16, None, None, torch.bfloat16),
}
LENS = [1, 5, 16, 17, 40, 63]   # ragged, on and across block boundaries


def make(seed, heads, kv_heads, dim, block, lens, pool_dtype):
    """Random q and pools, and block tables scattered over the pool (``[B, width]`` int64)."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block) for n in lens) + 3
    # a layer's view of the pool: [blocks, kv_heads, block, dim] over head-major storage
    k_pool = torch.randn(kv_heads, blocks, block, dim, generator=g).to(pool_dtype).transpose(0, 1)
    v_pool = torch.randn(kv_heads, blocks, block, dim, generator=g).to(pool_dtype).transpose(0, 1)
    q = torch.randn(len(lens), heads, dim, generator=g)
    order = torch.randperm(blocks, generator=g)
    tables = torch.zeros(len(lens), max(-(-n // block) for n in lens) + 1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        m = -(-n // block)
        tables[i, :m] = order[used:used + m]
        used += m
    return q, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32)


def model_decode() -> dict:
    """A tiny GQA Llama's decode step through SDPA and through the kernel (the dispatch
    `engine.attention` takes for a batch carrying ``decode_lens_t``)."""
    from engine.attention import ForwardBatch, SeqChunk
    from engine.config import CacheConfig
    from engine.kv_cache import KVPool
    from tests.unit.test_engine_runner import TINY, _model

    model, block = _model(3), 16
    pool = KVPool(TINY, CacheConfig(block_size=block, num_blocks=16))
    prompts = [list(range(1, 30)), list(range(5, 12)), list(range(2, 50))]
    tables = [pool.allocator.allocate(-(-(len(p) + 1) // block)) for p in prompts]
    for p, t in zip(prompts, tables):
        model.forward(ForwardBatch.build([SeqChunk(p, 0, t)], block), pool)
    step = ForwardBatch.build([SeqChunk([7], len(p), t) for p, t in zip(prompts, tables)], block)
    sdpa = model.forward(step, pool)
    lens = torch.tensor(step.decode_lens, dtype=torch.int32)
    return {"sdpa": sdpa, "kernel": model.forward(dataclasses.replace(step, decode_lens_t=lens), pool)}


def main(out: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from engine.triton_attention import paged_decode

    results = {}
    for seed, (name, (heads, kv_heads, dim, block, window, softcap, dtype)) in enumerate(CASES.items()):
        q, k_pool, v_pool, tables, lens = make(seed, heads, kv_heads, dim, block, LENS, dtype)
        scale = 0.7 * dim ** -0.5
        out_ = paged_decode(q, k_pool, v_pool, tables, lens, block, window, scale, softcap)
        other = tables.clone()
        other[-1, -2] = tables[0, 0]   # the last sequence's last block read from another sequence's
        wrong = paged_decode(q, k_pool, v_pool, other, lens, block, window, scale, softcap)
        results[name] = dict(q=q, k_pool=k_pool, v_pool=v_pool, tables=tables, lens=lens, block=block,
                             window=window, scale=scale, softcap=softcap, out=out_, wrong=wrong)
    errors = {}
    q, k_pool, v_pool, tables, lens = make(0, 6, 4, 16, 16, [3], torch.float32)
    for label, call in (("heads", lambda: paged_decode(q, k_pool, v_pool, tables, lens, 16)),
                        ("block", lambda: paged_decode(q[:, :4], k_pool, v_pool, tables, lens, 24)),
                        ("window", lambda: paged_decode(q[:, :4], k_pool, v_pool, tables, lens, 16, window=0))):
        try:
            call()
            errors[label] = None
        except ValueError as exc:
            errors[label] = str(exc)
    torch.save({"cases": results, "errors": errors, "model": model_decode()}, out)


if __name__ == "__main__":
    main(sys.argv[1])
