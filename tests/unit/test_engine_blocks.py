"""Block allocator, KV pool layout and batch construction: pure logic."""

from __future__ import annotations

import pytest
import torch

from engine.attention import DecodeGroup, ForwardBatch, SeqChunk
from engine.config import CacheConfig, ModelConfig
from engine.errors import CapacityError
from engine.ids import BlockId
from engine.kv_cache import BlockAllocator, KVPool, blocks_needed

pytestmark = pytest.mark.unit

TINY = ModelConfig(name="tiny", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position=128, tie_word_embeddings=True)


def test_allocate_free_refcounts():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert len(set(blocks)) == 3 and a.num_free == 1
    a.incref(blocks[:1])
    a.free(blocks)
    assert a.num_free == 3 and a.ref_count(blocks[0]) == 1
    a.free(blocks[:1])
    assert a.num_free == 4


def test_peak_used_blocks_is_the_high_water_mark_of_referenced_blocks():
    a = BlockAllocator(8)
    first = a.allocate(3)
    second = a.allocate(2)
    a.free(first)
    a.allocate(1)
    assert a.stats["peak_used_blocks"] == 5
    a.register(second[0], b"h0")
    a.free(second)             # second[0] is cached, unreferenced: not used
    assert a.lookup([b"h0"]) == [second[0]] and a.stats["peak_used_blocks"] == 5
    a.allocate(6)              # 1 + 1 (the cache hit) + 6: the whole pool, nothing evicted
    assert a.stats["peak_used_blocks"] == 8


def test_over_allocation_raises_and_takes_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(CapacityError, match="1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1


def test_a_run_leaves_its_gap_free_and_growth_takes_the_blocks_after_it():
    a = BlockAllocator(32)
    first = a.try_allocate(4, gap=3)
    second = a.try_allocate(4, gap=3)
    assert first == [0, 1, 2, 3] and second == [7, 8, 9, 10]   # 4..6: the first one's gap
    assert a.try_allocate(2, after=first[-1]) == [4, 5]          # growth runs on, not scattered
    assert a.try_allocate(2, after=5) == [6, 14]                 # past the gap: the next run
    assert a.try_allocate(1, after=second[-1]) == [11]


def test_blocks_taken_after_a_row_are_never_handed_out_twice():
    a = BlockAllocator(10)
    row = a.try_allocate(2)                                      # 0, 1
    grown = a.try_allocate(4)                                    # 2..5
    a.try_allocate(1)                                            # 6
    a.try_allocate(3)                                            # 7..9: the next search wraps to 0
    a.free(grown)
    a.free([BlockId(8)])
    got = a.try_allocate(5, after=row[-1])                       # 2..5 after the row, stopped by 6
    assert got == [2, 3, 4, 5, 8] and a.num_free == 0


def test_a_gap_is_not_a_reservation_and_placement_never_fails_an_allocation():
    a = BlockAllocator(12)
    runs = [a.try_allocate(2, gap=2) for _ in range(3)]          # 0-1, 4-5, 8-9: gaps at 2-3, 6-7, 10-11
    assert runs == [[0, 1], [4, 5], [8, 9]]
    assert a.try_allocate(3, gap=2) == [2, 3, 6]                 # no run of 3: free blocks by address
    assert a.try_allocate(3) == [7, 10, 11] and a.num_free == 0
    assert a.try_allocate(1) is None


def test_plain_free_blocks_go_before_cached_ones_and_freed_blocks_are_reused():
    a = BlockAllocator(6)
    blocks = a.allocate(6)
    a.register(blocks[0], b"h0")
    a.free(blocks[:3])                                           # 0 cached, 1 and 2 plain free
    assert a.num_free == 3 and a.num_cached == 1
    assert a.try_allocate(3, gap=4) == [1, 2, 0] and a.stats["cache_evictions"] == 1
    assert a.lookup([b"h0"]) == []


def test_double_free_is_an_error():
    a = BlockAllocator(2)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_pool_is_one_contiguous_tensor_in_the_documented_layout():
    pool = KVPool(TINY, CacheConfig(block_size=8, num_blocks=5))
    assert pool.kv.shape == (2, 2, 2, 5, 8, 4)   # layers, K/V, KV heads, blocks, block size, head dim
    assert pool.kv.is_contiguous()
    assert pool.kv.numel() * 4 == KVPool.nbytes_for(TINY, pool.cache)
    k, v = pool.layer_view(1)
    assert k.shape == (5, 2, 8, 4)   # viewed [blocks, KV heads, block size, head dim]
    k[3, 1, 2] = 7.0  # block 3, KV head 1, offset 2 of layer 1's K
    assert torch.all(pool.kv[1, 0, 1, 3, 2] == 7.0)
    assert pool.kv[1, 0, 1, 2:5].is_contiguous()   # one head's consecutive blocks: one range
    assert v.data_ptr() == pool.kv[1, 1].data_ptr()


def test_pool_over_external_buffer():
    nbytes = KVPool.nbytes_for(TINY, CacheConfig(block_size=8, num_blocks=5))
    buf = torch.full((nbytes + 10,), 0xFF, dtype=torch.uint8)
    pool = KVPool(TINY, CacheConfig(block_size=8, num_blocks=5), buffer=buf)
    assert pool.kv.data_ptr() == buf.data_ptr() and int(buf[:nbytes].sum()) == 0
    with pytest.raises(CapacityError):
        KVPool(TINY, CacheConfig(block_size=8, num_blocks=5), buffer=buf[:100])


def test_forward_batch_slots_and_decode_mask():
    batch = ForwardBatch.build([SeqChunk([5], 9, [3, 1]), SeqChunk([6], 2, [4])], block_size=8)
    assert batch.is_decode
    assert batch.slot_mapping.tolist() == [1 * 8 + 1, 4 * 8 + 2]
    assert batch.block_tables.tolist() == [[3, 1], [4, 0]]
    assert batch.attn_mask[0, 0, 0].sum() == 10 and batch.attn_mask[1, 0, 0].sum() == 3


def test_forward_batch_rejects_short_block_table():
    with pytest.raises(ValueError):
        ForwardBatch.build([SeqChunk([1] * 9, 0, [0])], block_size=8)


def test_decode_groups_cover_every_row_within_the_token_budget():
    lens = [10, 3, 40, 40, 7, 90, 2]
    tables = torch.arange(len(lens) * 12).view(len(lens), 12)
    groups = DecodeGroup.plan(tables, lens, budget_tokens=80)
    assert [(g.lo, g.hi) for g in groups] == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7)]
    for g in groups:
        assert g.span == max(lens[g.lo:g.hi])
        assert (g.hi - g.lo) * g.span <= 80 or g.hi - g.lo == 1   # a 90-token row stands alone
        assert g.blocks.tolist() == tables[g.lo:g.hi].reshape(-1).tolist()
        if g.bias is None:
            assert all(n == g.span for n in lens[g.lo:g.hi])
        else:   # -inf exactly past each row's context
            attended = (g.bias[:, 0, 0] == 0).sum(-1).tolist()
            assert attended == lens[g.lo:g.hi]
            assert torch.isinf(g.bias).sum().item() == sum(g.span - n for n in lens[g.lo:g.hi])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_equals_per_sequence_attention(pool_dtype, monkeypatch):
    """Decode attention in groups (grouped-query rows, cast copies, per-group spans) returns what
    plain SDPA returns for each sequence alone over exactly its context, with K/V expanded."""
    import torch.nn.functional as F

    import engine.attention as attention

    monkeypatch.setattr(attention, "DECODE_GROUP_TOKENS", 100)   # several groups of uneven rows
    gen = torch.Generator().manual_seed(3)
    block, kv_heads, heads, dim = 8, 2, 6, 16
    # a layer's view of the pool: [blocks, kv_heads, block, dim] over head-major storage
    pool_k = torch.randn(kv_heads, 64, block, dim, generator=gen).to(pool_dtype).transpose(0, 1)
    pool_v = torch.randn(kv_heads, 64, block, dim, generator=gen).to(pool_dtype).transpose(0, 1)
    contexts = [17, 5, 33, 33, 60, 1, 24]   # tokens already in the pool, the new one included
    tables = torch.randperm(64, generator=gen)[:len(contexts) * 8].view(len(contexts), 8).tolist()
    chunks = [SeqChunk([1], n - 1, t[:-(-n // block)]) for n, t in zip(contexts, tables)]
    batch = ForwardBatch.build(chunks, block)
    assert len(batch.decode_groups) > 2
    q = torch.randn(len(contexts), heads, dim, generator=gen)
    out = attention.paged_attention(q, None, None, pool_k, pool_v, batch, block)
    for i, (n, table) in enumerate(zip(contexts, tables)):
        slots = [table[p // block] * block + p % block for p in range(n)]
        k = pool_k.transpose(1, 2).reshape(-1, kv_heads, dim)[slots].float().transpose(0, 1)[None]
        v = pool_v.transpose(1, 2).reshape(-1, kv_heads, dim)[slots].float().transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[i][None, :, None], k, v, enable_gqa=True)
        torch.testing.assert_close(out[i], ref.reshape(-1), rtol=1e-5, atol=1e-5)


def test_decode_rows_form_one_group_off_the_cpu():
    batch = ForwardBatch.build([SeqChunk([1], n - 1, list(range(8 * i, 8 * i + 8))) for i, n in
                                enumerate([50, 64, 20])], block_size=8)
    assert len(DecodeGroup.plan(batch.block_tables, batch.decode_lens, 60)) == 3
    (whole,) = DecodeGroup.plan(batch.block_tables, batch.decode_lens, None)
    assert (whole.lo, whole.hi, whole.span) == (0, 3, 64)
    assert (whole.bias[:, 0, 0] == 0).sum(-1).tolist() == [50, 64, 20]
    moved = batch.to(torch.device("meta"))
    assert len(moved.decode_groups) == 1 and moved.decode_groups[0].blocks.device.type == "meta"


def test_padded_prefill_equals_one_call_per_prompt():
    """Off the CPU a pass of whole prompts attends as one right-padded causal SDPA
    (`ForwardBatch.plan_padded_prefill`): forced here on the CPU, it gives the per-prompt path's
    output for ragged prompts with grouped-query heads, and a sliding window longer than every
    prompt. Passes it cannot serve keep the per-prompt path."""
    import engine.attention as attention

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 6, 2, 16, 8
    lengths = [5, 17, 12, 9]
    tables = [list(range(4 * i, 4 * i + 3)) for i in range(len(lengths))]
    batch = ForwardBatch.build([SeqChunk(list(range(n)), 0, t) for n, t in zip(lengths, tables)], block)
    rows = sum(lengths)
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = torch.randn(rows, kv_heads, dim, generator=gen), torch.randn(rows, kv_heads, dim, generator=gen)
    pool_k = pool_v = torch.zeros(16, kv_heads, block, dim)
    want = attention.paged_attention(q, k, v, pool_k, pool_v, batch, block, window=32)
    pad = batch.plan_padded_prefill()
    assert pad[0] == 17 and pad[1].tolist()[:6] == [0, 1, 2, 3, 4, 17]
    batch.prefill_pad = pad
    got = attention.paged_attention(q, k, v, pool_k, pool_v, batch, block, window=32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - attention.paged_attention(q, k, v, pool_k, pool_v, batch, block, window=4)).abs().max() > 1e-3
    # prompts of one length: the rows are the padded batch already (no index, no copies)
    even = ForwardBatch.build([SeqChunk(list(range(9)), 0, t) for t in tables], block)
    q9, k9, v9 = q[:36], k[:36], v[:36]
    want = attention.paged_attention(q9, k9, v9, pool_k, pool_v, even, block)
    even.prefill_pad = even.plan_padded_prefill()
    assert even.prefill_pad == (9, None)
    torch.testing.assert_close(attention.paged_attention(q9, k9, v9, pool_k, pool_v, even, block), want,
                               rtol=1e-5, atol=1e-5)
    # a chunk with cached context, a one-token row among prompts, or padding over twice the rows: None
    assert ForwardBatch.build([SeqChunk([1, 2], 0, [0]), SeqChunk([3, 4], 5, [1])], block).plan_padded_prefill() is None
    assert ForwardBatch.build([SeqChunk([1, 2], 0, [0]), SeqChunk([3], 4, [1]), SeqChunk([5], 2, [2])],
                              block).plan_padded_prefill() is None
    assert ForwardBatch.build([SeqChunk(list(range(40)), 0, list(range(5))), SeqChunk([1], 0, [6]),
                               SeqChunk([2], 0, [7])], block).plan_padded_prefill() is None
    assert batch.to(torch.device("meta")).prefill_pad is not None and batch.to(torch.device("cpu")).prefill_pad is None


def _chunks_over_a_bfloat16_pool(gen: torch.Generator, cases: list[tuple[int, int]], kv_heads: int, dim: int,
                                 block: int):
    """A prompt pass of ``cases`` (chunk tokens, cached tokens before it) over a random head-major
    bfloat16 pool, each chunk's table 10 scattered blocks: ``(pool_k, pool_v, tables, batch)``."""
    blocks = 10 * len(cases)
    pool_k = torch.randn(kv_heads, blocks, block, dim, generator=gen).bfloat16().transpose(0, 1)
    pool_v = torch.randn(kv_heads, blocks, block, dim, generator=gen).bfloat16().transpose(0, 1)
    tables = torch.randperm(blocks, generator=gen).view(len(cases), 10).tolist()
    batch = ForwardBatch.build([SeqChunk([1] * n, past, t) for (n, past), t in zip(cases, tables)], block)
    return pool_k, pool_v, tables, batch


def test_a_chunk_after_cached_context_attends_as_the_masked_reference():
    """A prompt chunk after cached context (a prefix-cache hit, a later chunk of a long prompt) on
    the CPU (`engine.attention.causal_after_context`: two flash calls merged by their
    log-sum-exps, or, for a context of at most a quarter of the chunk, one causal call over the
    queries padded at the front) equals the reference: the whole context gathered from the pool,
    repeated per query head, under the explicit mask (grouped-query heads, contexts of one block,
    a partial block, many blocks; a one-token chunk among them; chunks at and past the quarter;
    scores scaled so that a wrong merge weight or a misplaced mask shows)."""
    import engine.attention as attention

    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block = 6, 2, 16, 8
    cases = [(30, 8), (12, 5), (2, 61), (1, 20), (40, 10), (33, 8)]   # (chunk tokens, cached tokens before it)
    pool_k, pool_v, tables, batch = _chunks_over_a_bfloat16_pool(gen, cases, kv_heads, dim, block)
    rows = sum(n for n, _ in cases)
    q = torch.randn(rows, heads, dim, generator=gen) * 4
    out = attention.paged_attention(q, None, None, pool_k, pool_v, batch, block)
    first = 0
    for (n, past), table in zip(cases, tables):
        ctx = past + n
        slots = [table[p // block] * block + p % block for p in range(ctx)]
        k, v = (pool.transpose(1, 2).reshape(-1, kv_heads, dim)[slots].float().transpose(0, 1)
                .repeat_interleave(heads // kv_heads, 0) for pool in (pool_k, pool_v))
        scores = q[first:first + n].transpose(0, 1) @ k.transpose(1, 2) / dim ** 0.5   # [heads, n, ctx]
        hidden = torch.arange(ctx)[None, :] > torch.arange(past, ctx)[:, None]
        ref = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v        # [heads, n, dim]
        torch.testing.assert_close(out[first:first + n], ref.transpose(0, 1).reshape(n, -1), rtol=1e-5, atol=1e-5)
        first += n
    q16, k16 = torch.randn(1, heads, 3, dim).bfloat16(), torch.randn(1, kv_heads, 9, dim).bfloat16()
    assert attention.causal_after_context(q16, k16, k16, None).dtype == torch.bfloat16   # in q's dtype


def _indexed_case(block: int, gen: torch.Generator, heads: int = 6):
    """A decode batch over a head-major bfloat16 pool (ragged contexts, scattered tables,
    grouped-query heads ``heads`` over 2, head_dim 64): ``(q, pool_k, pool_v, batch, lens)``."""
    kv_heads, dim = 2, 64
    pool_k = torch.randn(kv_heads, 64, block, dim, generator=gen).bfloat16().transpose(0, 1)
    pool_v = torch.randn(kv_heads, 64, block, dim, generator=gen).bfloat16().transpose(0, 1)
    contexts = [17, 5, 33, 33, 60, 1, 24]
    per_seq = -(-max(contexts) // block)
    tables = torch.randperm(64, generator=gen)[:len(contexts) * per_seq].view(len(contexts), per_seq).tolist()
    chunks = [SeqChunk([1], n - 1, t[:-(-n // block)]) for n, t in zip(contexts, tables)]
    q = torch.randn(len(contexts), heads, dim, generator=gen) * 3   # scores large enough to matter
    return q, pool_k, pool_v, ForwardBatch.build(chunks, block), torch.tensor(contexts)


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 5.0), (9, 5.0)])
@pytest.mark.parametrize("heads", [6, 20])
def test_indexed_decode_attention_equals_the_grouped_path(block, window, softcap, heads):
    """`paged_decode_indexed` (the pool read through the block table by indexing) returns what the
    serving path returns, with sliding windows shorter and longer than some contexts and with
    soft-capping, for 3 query heads per KV head (a reduction each, fused; the value sums in two
    head-dimension chunks each) and 10 (above `MAX_FUSED_GROUPS`: one reduction); a wrong window
    or cap changes its output (the comparison can fail)."""
    from engine.attention import paged_attention
    from engine.paged_decode import MAX_FUSED_GROUPS, paged_decode_indexed, value_chunks

    assert 6 // 2 <= MAX_FUSED_GROUPS < 20 // 2   # both forms of the scores are exercised
    assert value_chunks(6 // 2, 64) == 2          # and the value sums in chunks
    q, pool_k, pool_v, batch, lens = _indexed_case(block, torch.Generator().manual_seed(5), heads)
    want = paged_attention(q, None, None, pool_k, pool_v, batch, block, window=window, scale=0.3, softcap=softcap)
    got = paged_decode_indexed(q, pool_k, pool_v, batch.block_tables, lens, window, 0.3, softcap)
    assert got.shape == want.shape == (q.shape[0], q.shape[1] * q.shape[2])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wrong = paged_decode_indexed(q, pool_k, pool_v, batch.block_tables, lens, (window or 40) - 7, 0.3,
                                 None if softcap else 2.0)
    assert (wrong - want).abs().max() > 1e-2


def test_value_chunks_split_the_head_dimension_within_the_register_budget():
    """`value_chunks`: pieces of `VALUE_CHUNK` elements that divide the head dimension, at most
    `MAX_VALUE_REDUCTIONS` reductions with the query heads of a KV head."""
    from engine.paged_decode import value_chunks

    assert [value_chunks(3, 64), value_chunks(1, 64), value_chunks(4, 128), value_chunks(8, 128)] == [2, 2, 4, 2]
    assert [value_chunks(3, 16), value_chunks(1, 80), value_chunks(1, 96), value_chunks(8, 96)] == [1, 2, 3, 2]


def test_compiled_indexed_decode_attention_serves_every_batch_and_context_from_one_package():
    """Compiled ahead of time (`engine.paged_decode.CompiledDecode`: AOTInductor, batch and table
    width dynamic) the indexed kernel equals the serving path on two batches of different sizes,
    block-table widths and contexts over a head-major pool, from one package (a worker's block
    size and model shapes are fixed, so one package serves all its decode steps)."""
    from engine.attention import paged_attention
    from engine.paged_decode import CompiledDecode

    kernel = CompiledDecode()
    block = 8
    q_all, pool_k, pool_v, batch, lens_all = _indexed_case(block, torch.Generator().manual_seed(6))
    # every row, 8 table columns; then the rows of at most 33 tokens, 5 columns
    for rows, width in ((list(range(len(lens_all))), 8), ([0, 1, 2, 3, 6], 5)):
        q, lens = q_all[rows], lens_all[rows]
        tables = batch.block_tables[rows, :width].contiguous()
        sub = ForwardBatch.build([SeqChunk([1], int(n) - 1, tables[i, :-(-int(n) // block)])
                                  for i, n in enumerate(lens)], block)
        assert sub.block_tables.shape == (len(rows), width)
        want = paged_attention(q, None, None, pool_k, pool_v, sub, block)
        torch.testing.assert_close(kernel(q, pool_k, pool_v, sub, None, None, None), want, rtol=1e-5, atol=1e-5)
    assert len(kernel.packages) == 1


def test_compiled_decode_attention_in_length_groups_equals_one_call_and_the_serving_path():
    """`engine.paged_decode.length_groups` splits a ragged batch into groups of similar context
    (every row once, ascending length, each group's table as wide as its longest row needs, at
    least two rows and columns), and `CompiledDecode` through those groups (on one thread)
    returns what one call of its package over the whole table and the serving path return;
    uniform or tiny batches stay one call."""
    from engine.attention import paged_attention
    from engine.paged_decode import MAX_LENGTH_GROUPS, CompiledDecode, length_groups

    block = 8
    q, pool_k, pool_v, batch, lens = _indexed_case(block, torch.Generator().manual_seed(7))
    tables, lens_t = batch.indexed_decode_inputs()
    groups = length_groups(tables, lens_t, block)
    assert groups is not None and len(groups) == min(MAX_LENGTH_GROUPS, len(lens) // 2)
    rows = torch.cat([g[0] for g in groups])
    assert sorted(rows.tolist()) == list(range(len(lens))) and lens[rows].tolist() == sorted(lens.tolist())
    for index, group_tables, group_lens in groups:
        assert len(index) >= 2 and torch.equal(group_lens, lens_t[index])
        assert group_tables.shape[1] == max(2, int(-(-group_lens.max() // block))) <= tables.shape[1]
        assert torch.equal(group_tables, tables[index, :group_tables.shape[1]])
    kernel, threads = CompiledDecode(), torch.get_num_threads()
    torch.set_num_threads(1)   # the groups are taken on one thread only
    try:
        got = kernel(q, pool_k, pool_v, batch, None, None, None)
    finally:
        torch.set_num_threads(threads)
    assert batch.memo(("length_groups", block), lambda: None) is not None   # it went through them
    (package,) = kernel.packages.values()
    torch.testing.assert_close(got, package(q.contiguous(), pool_k, pool_v, tables, lens_t)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, paged_attention(q, None, None, pool_k, pool_v, batch, block), rtol=1e-5, atol=1e-5)
    uniform = torch.full((6,), 40)
    assert length_groups(tables[:6, :5], uniform, block) is None   # nothing padded to save
    assert length_groups(tables[:3], lens_t[:3], block) is None   # too few rows to split


def test_a_model_decodes_through_the_compiled_kernel_as_through_the_grouped_path():
    """A tiny model's decode steps (ragged contexts, a batch of one, a mixed pass of a prompt
    chunk beside one-token sequences) give the same logits through `CompiledDecode` as through
    the grouped path, its warm-up loads or builds the package and every step after it runs that
    package, and the caller's thread count is left as it was."""
    from engine.paged_decode import CompiledDecode
    from tests.unit.test_engine_runner import TINY, _model

    model = _model(4)
    pool = KVPool(TINY, CacheConfig(block_size=4, num_blocks=64))
    prompts = [[3 + i] * n for i, n in enumerate([5, 13, 2, 9])]
    tables = [pool.allocator.allocate(6) for _ in prompts]

    def steps():
        outs = []
        for p, t in zip(prompts, tables):
            model.forward(ForwardBatch.build([SeqChunk(p, 0, t)], 4), pool)
        for step in range(3):
            chunks = [SeqChunk([7 + step], len(p) + step, t) for p, t in zip(prompts, tables)]
            outs.append(model.forward(ForwardBatch.build(chunks, 4), pool))
            outs.append(model.forward(ForwardBatch.build(chunks[:1], 4), pool))
        mixed = [SeqChunk([9, 8, 7], 0, tables[0][:1]), SeqChunk([5], len(prompts[1]) + 3, tables[1])]
        outs.append(model.forward(ForwardBatch.build(mixed, 4), pool))
        return outs

    want = steps()
    kernel = model.decode_kernel = CompiledDecode(min_rows=1)   # a lone row too
    try:
        assert model.warm_up(pool) > 0
        assert len(kernel.packages) == 1
        threads = torch.get_num_threads()
        got = steps()
        assert torch.get_num_threads() == threads
    finally:
        model.decode_kernel = None
    assert len(kernel.packages) == 1
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_decode_batches_below_the_kernels_min_rows_keep_the_grouped_path():
    """`CompiledDecode` runs only for decode batches of at least ``min_rows`` sequences (its fixed
    cost per call outweighs its gain below); its package is replaced here by an eager
    counting stand-in, since what is checked is the dispatch, not the compiled code."""
    from engine.paged_decode import CompiledDecode, paged_decode_indexed
    from tests.unit.test_engine_runner import TINY, _model

    model = _model(4)
    pool = KVPool(TINY, CacheConfig(block_size=4, num_blocks=16))
    kernel = CompiledDecode(min_rows=3)
    calls = []

    def package(q, k_pool, v_pool, window, scale, softcap):   # the stand-in for the compiled package
        def run(q, k_pool, v_pool, tables, lens):
            calls.append(q.shape[0])
            return [paged_decode_indexed(q, k_pool, v_pool, tables, lens, window, scale, softcap)]
        return run

    kernel.package = package
    model.decode_kernel = kernel
    tables = [pool.allocator.allocate(2) for _ in range(3)]
    for t in tables:
        model.forward(ForwardBatch.build([SeqChunk([5, 6, 7], 0, t)], 4), pool)
    model.forward(ForwardBatch.build([SeqChunk([1], 3, t) for t in tables[:2]], 4), pool)
    assert calls == []
    model.forward(ForwardBatch.build([SeqChunk([1], 3, t) for t in tables], 4), pool)
    assert calls == [3] * TINY.num_layers


def test_prompt_chunks_attend_in_the_given_dtype_and_one_token_rows_do_not():
    """``paged_attention(..., prefill_dtype=torch.bfloat16)`` (`engine.prefill_choice` takes it
    where it was timed faster): a fresh prompt chunk and a chunk after cached context attend
    exactly as torch's SDPA / the merged flash calls do in bfloat16 on the queries rounded to it
    and the pool's K/V, the output back in float32, within bfloat16's tolerance of float32
    attention and not equal to it; a one-token sequence among them, and soft-capped scores,
    stay in float32, bit for bit."""
    import torch.nn.functional as F

    import engine.attention as attention

    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, dim, block = 6, 2, 16, 8
    cases = [(30, 8), (12, 0), (1, 20), (17, 0), (33, 8)]   # (chunk tokens, cached tokens before it)
    pool_k, pool_v, tables, batch = _chunks_over_a_bfloat16_pool(gen, cases, kv_heads, dim, block)
    assert batch.decode_rows is None   # the one-token sequence goes through the per-chunk loop
    own = [[t[p // block] * block + p % block for p in range(past, past + n)] for (n, past), t in zip(cases, tables)]
    k, v = (pool.transpose(1, 2).reshape(-1, kv_heads, dim)[sum(own, [])] for pool in (pool_k, pool_v))
    q = torch.randn(k.shape[0], heads, dim, generator=gen) * 4
    out32 = attention.paged_attention(q, k, v, pool_k, pool_v, batch, block)
    out16 = attention.paged_attention(q, k, v, pool_k, pool_v, batch, block, prefill_dtype=torch.bfloat16)
    assert out16.dtype == torch.float32
    first = 0
    for (n, past), rows in zip(cases, own):
        got, want32 = out16[first:first + n], out32[first:first + n]
        if n == 1:
            assert torch.equal(got, want32)
        else:
            qs = q[first:first + n].bfloat16().transpose(0, 1)[None]
            ctx = [t[p // block] * block + p % block for t in [tables[cases.index((n, past))]] for p in range(past + n)]
            ks, vs = (pool.transpose(1, 2).reshape(-1, kv_heads, dim)[ctx].transpose(0, 1)[None]
                      for pool in (pool_k, pool_v))
            want = (F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True) if past == 0
                    else attention.causal_after_context(qs, ks, vs, None))
            assert torch.equal(got, want[0].transpose(0, 1).reshape(n, -1).float())
            torch.testing.assert_close(got, want32, rtol=3e-2, atol=3e-2)
            assert (got - want32).abs().max() > 0
        first += n
    capped = attention.paged_attention(q, k, v, pool_k, pool_v, batch, block, softcap=5.0, prefill_dtype=torch.bfloat16)
    assert torch.equal(capped, attention.paged_attention(q, k, v, pool_k, pool_v, batch, block, softcap=5.0))
