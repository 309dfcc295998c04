"""The CPU prompt-attention kernel (`engine.flex_prefill.CompiledPrefill`: FlexAttention through
inductor) against torch's SDPA: every length (partial last blocks included), grouped and plain
heads, one graph per thread count for every length; and `engine.attention.paged_attention`'s
dispatch to it (prompts it takes, not shorter ones, not chunks with cached context), a model's
logits through it equal to SDPA's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import ForwardBatch, SeqChunk, paged_attention
from engine.config import CacheConfig
from engine.flex_prefill import BLOCK, CompiledPrefill, causal_block_mask
from engine.kv_cache import KVPool

pytestmark = pytest.mark.unit


def _sdpa(q, k, v, scale):
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, enable_gqa=True, scale=scale)
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


@pytest.fixture(scope="module")
def kernel():
    return CompiledPrefill()


def test_the_causal_block_mask_reads_each_key_block_once_up_to_the_diagonal():
    mask = causal_block_mask(3 * BLOCK + 5)   # 4 blocks, the last partial
    dense = mask.to_dense()[0, 0]
    assert dense.shape == (4, 4) and torch.equal(dense, torch.ones(4, 4).tril().to(dense.dtype))
    assert mask.seq_lengths == (3 * BLOCK + 5, 3 * BLOCK + 5)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
def test_the_kernel_equals_sdpa_at_every_length_from_one_graph(kernel, heads, kv_heads):
    """Lengths on and off the block edges; scores scaled large (x3) so a key seen or hidden
    wrongly moves the output; a scale other than the default."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(heads)
    kernel(*(torch.randn(kernel.min_tokens, h, 16, generator=g) for h in (heads, kv_heads, kv_heads)), 0.3)
    compiled = counters["stats"]["unique_graphs"]
    for n in (kernel.min_tokens, 200, 4 * BLOCK, 4 * BLOCK + 1, 517):
        q, k, v = (torch.randn(n, h, 16, generator=g) * 3 for h in (heads, kv_heads, kv_heads))
        torch.testing.assert_close(kernel(q, k, v, 0.3), _sdpa(q, k, v, 0.3), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == compiled   # no length built another graph


class _Calls(CompiledPrefill):
    """The real kernel, recording each prompt length it attends."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def __call__(self, q, k, v, scale=None):
        self.lengths.append(q.shape[0])
        return super().__call__(q, k, v, scale)


def test_paged_attention_sends_whole_prompts_it_takes_and_nothing_else():
    """A pass of three prompts (one too short for the kernel) and then a chunk with cached
    context: only the long prompts with no context go through the kernel, and every row equals
    the SDPA path's."""
    kernel = _Calls()
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    lens = (kernel.min_tokens + 10, kernel.min_tokens - 1, kernel.min_tokens + 70)
    pool = torch.zeros(2, 64, kv_heads, bs, dim)
    tables = [torch.arange(i * 20, i * 20 + 20) for i in range(3)]
    batch = ForwardBatch.build([SeqChunk([1] * n, 0, t) for n, t in zip(lens, tables)], bs)
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    q, k, v = torch.randn(t, heads, dim, generator=g), torch.randn(t, kv_heads, dim, generator=g), torch.randn(
        t, kv_heads, dim, generator=g)
    want = paged_attention(q, k, v, pool[0], pool[1], batch, bs)
    got = paged_attention(q, k, v, pool[0], pool[1], batch, bs, prefill_kernel=kernel)
    assert kernel.lengths == [lens[0], lens[2]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ctx = ForwardBatch.build([SeqChunk([1] * kernel.min_tokens, 40, tables[0])], bs)   # 40 tokens cached
    paged_attention(q[:kernel.min_tokens], k[:kernel.min_tokens], v[:kernel.min_tokens], pool[0], pool[1], ctx, bs,
                    prefill_kernel=kernel)
    assert kernel.lengths == [lens[0], lens[2]]


def test_a_models_prompt_logits_through_the_kernel_equal_sdpas():
    import dataclasses

    from tests.unit.test_engine_runner import TINY, _model

    config = dataclasses.replace(TINY, max_position=512)
    model = _model(7, config)
    pool = KVPool(config, CacheConfig(block_size=4, num_blocks=128))
    n = CompiledPrefill.min_tokens + 37
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = ForwardBatch.build([SeqChunk(ids, 0, pool.allocator.allocate(-(-n // 4)))], 4)
    batch.logits_indices = torch.arange(n)
    want = model.forward(batch, pool)
    model.prefill_kernel = _Calls()
    try:
        assert model.warm_up(pool) > 0
        got = model.forward(batch, pool)
    finally:
        kernel, model.prefill_kernel = model.prefill_kernel, None
    assert kernel.lengths == [kernel.min_tokens] + [n] * config.num_layers   # the warm-up's, then each layer's
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
