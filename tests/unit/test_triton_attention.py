"""`engine.triton_attention.paged_decode` against a reference, on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the module is imported): grouped-query heads,
ragged lengths, scattered block tables, block sizes, sliding windows, soft-capping, a bfloat16
pool. The same kernel is what CUDA pools run (`engine.attention`)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: it reads it then
pytest.importorskip("triton", reason="triton is in the dev extra")
triton_attention = importlib.import_module("engine.triton_attention")

pytestmark = pytest.mark.unit


def reference(q, k_pool, v_pool, tables, lens, block, window, scale, softcap):
    """Each sequence's K/V gathered by its table, attended in float64."""
    out = []
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    for i, n in enumerate(lens.tolist()):
        slots = (tables[i, :, None] * block + torch.arange(block)).flatten()[:n]
        k = k_pool[slots].double().repeat_interleave(heads // kv_heads, dim=1)   # [n, heads, dim]
        v = v_pool[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s[:, : max(0, n - window)] = float("-inf")
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def case(seed, heads, kv_heads, dim, block, lens, pool_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block) for n in lens) + 3
    k_pool = torch.randn(blocks * block, kv_heads, dim, generator=g).to(pool_dtype)
    v_pool = torch.randn(blocks * block, kv_heads, dim, generator=g).to(pool_dtype)
    q = torch.randn(len(lens), heads, dim, generator=g)
    order = torch.randperm(blocks, generator=g)   # scattered: a sequence's blocks are not consecutive
    width = max(-(-n // block) for n in lens) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        m = -(-n // block)
        tables[i, :m] = order[used:used + m]
        used += m
    return q, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("heads, kv_heads, dim, block, window, softcap", [
    (4, 4, 16, 16, None, None),      # multi-head
    (8, 2, 32, 16, None, None),      # grouped-query
    (6, 2, 24, 32, None, None),      # 3 query heads per KV head, head_dim not a power of two
    (8, 2, 32, 16, 20, None),        # sliding window shorter than most contexts
    (8, 4, 32, 16, None, 5.0),       # Gemma 2's soft-capping
    (8, 1, 16, 16, 7, 3.0),          # all at once, one KV head
])
def test_paged_decode_equals_the_reference(heads, kv_heads, dim, block, window, softcap):
    lens = [1, 5, 16, 17, 40, 63]    # ragged, on and across block boundaries
    q, k_pool, v_pool, tables, n = case(0, heads, kv_heads, dim, block, lens)
    scale = 0.7 * dim ** -0.5
    got = triton_attention.paged_decode(q, k_pool, v_pool, tables, n, block, window, scale, softcap)
    want = reference(q, k_pool, v_pool, tables, n, block, window, scale, softcap)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - want).abs().max().item() < 2e-5


def test_a_bfloat16_pool_is_read_as_float32_and_a_wrong_table_is_caught():
    lens = [9, 33]
    q, k_pool, v_pool, tables, n = case(1, 4, 2, 16, 16, lens, torch.bfloat16)
    got = triton_attention.paged_decode(q, k_pool, v_pool, tables, n, 16)
    want = reference(q, k_pool.float(), v_pool.float(), tables, n, 16, None, 16 ** -0.5, None)
    assert (got.double() - want).abs().max().item() < 2e-5
    swapped = tables.clone()
    swapped[1, [0, 1]] = swapped[1, [1, 0]]   # blocks out of order: the kernel must follow the table
    wrong = triton_attention.paged_decode(q, k_pool, v_pool, swapped, n, 16, window=10)
    assert (wrong[1].double() - want[1]).abs().max().item() > 1e-2


def test_shapes_that_do_not_fit_are_refused():
    q, k_pool, v_pool, tables, n = case(2, 6, 4, 16, 16, [3])
    with pytest.raises(ValueError, match="does not fit"):
        triton_attention.paged_decode(q, k_pool, v_pool, tables, n, 16)
    q, k_pool, v_pool, tables, n = case(2, 4, 2, 16, 16, [3])
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.paged_decode(q, k_pool, v_pool, tables, n, 24)
    with pytest.raises(ValueError, match="positive"):
        triton_attention.paged_decode(q, k_pool, v_pool, tables, n, 16, window=0)


def test_a_model_decodes_through_the_kernel_as_through_sdpa():
    """The engine's dispatch (`engine.attention`: a batch carrying ``decode_lens_t``, as
    `ForwardBatch.to` gives CUDA batches) on a tiny Llama with GQA: the same logits."""
    import dataclasses

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
    want = model.forward(step, pool)
    lens = torch.tensor(step.decode_lens, dtype=torch.int32)
    got = model.forward(dataclasses.replace(step, decode_lens_t=lens), pool)
    assert (got - want).abs().max().item() < 1e-4
