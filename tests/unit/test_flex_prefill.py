"""The CPU prompt-attention kernel (`engine.flex_prefill.CompiledPrefill`: FlexAttention through
inductor) against torch's SDPA: every chunk length and cached context (partial last blocks
included), grouped and plain heads, one package for all of them; its score micro-GEMM built
with the register block of `engine.flex_prefill.QK_REGISTER_BLOCK` (512-bit code; the template's
own for 256-bit code); and
`engine.attention.paged_attention`'s dispatch to it (chunks it takes, with or without context,
not shorter ones), a model's logits through it equal to SDPA's."""

from __future__ import annotations

import logging
import zipfile

import pytest
import torch
import torch.nn.functional as F

from engine.attention import ForwardBatch, SeqChunk, paged_attention
from engine.config import CacheConfig
from engine.flex_prefill import BLOCK, QK_REGISTER_BLOCK, CompiledPrefill, causal_block_mask, qk_register_block
from engine.kv_cache import KVPool

pytestmark = pytest.mark.unit


def _sdpa(q, k, v, scale):
    """The reference: ``q`` ``[n, heads, dim]`` the last ``n`` of ``k``'s ``ctx`` positions."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, enable_gqa=True, scale=scale)
    return o[0].transpose(0, 1).reshape(n, -1)


@pytest.fixture(scope="module")
def kernel():
    return CompiledPrefill()


def test_the_causal_block_mask_reads_each_key_block_once_up_to_the_diagonal():
    mask = causal_block_mask(3 * BLOCK + 5)   # 4 blocks, the last partial
    dense = mask.to_dense()[0, 0]
    assert torch.equal(dense, torch.ones(4, 4).tril().to(dense.dtype))
    assert mask.seq_lengths == (3 * BLOCK + 5, 3 * BLOCK + 5)
    # 100 queries after 40 cached tokens: query block 0 (positions 40-103) reads key blocks 0-1,
    # block 1 (104-139) blocks 0-2; only block 0 of keys lies wholly before position 104
    mask = causal_block_mask(100, 140)
    assert mask.to_dense()[0, 0].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert mask.full_kv_num_blocks.view(-1).tolist() == [0, 1]
    with pytest.raises(ValueError, match="cannot sit past"):
        causal_block_mask(10, 9)


def test_a_kernel_builds_each_mask_once_for_a_pass_and_keeps_a_bounded_number(kernel, monkeypatch):
    """Every layer of a pass attends the same chunks: their masks are built at the first layer
    only; past `CompiledPrefill.MASKS` shapes the kept ones are dropped, not grown without end."""
    kernel._masks.clear()
    first = kernel.mask(300, 316, torch.device("cpu"))
    assert kernel.mask(300, 316, torch.device("cpu")) is first
    assert kernel.mask(300, 300, torch.device("cpu")) is not first
    monkeypatch.setattr(CompiledPrefill, "MASKS", 3)
    for n in range(200, 206):
        kernel.mask(n, n, torch.device("cpu"))
    assert 1 <= len(kernel._masks) <= 3
    assert torch.equal(kernel.mask(300, 316, torch.device("cpu")).to_dense(), first.to_dense())   # rebuilt alike


# grouped heads (3 KV heads, as many as the warm-up's first query blocks) and plain ones
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_the_kernel_equals_sdpa_at_every_length_context_and_layout_from_its_warm_up_graphs(kernel, heads, kv_heads):
    """Chunk lengths on and off the block edges, after no context and after contexts on and off
    them; scores scaled large (x3) so a key seen or hidden wrongly moves the output; a scale
    other than the default. Under ``inference_mode`` as a model's forward runs, with the
    operands in the layouts `paged_attention` passes (K/V cut from a pass's projections, or
    gathered head-major from the pool; queries a view of a wider row): after the kernel's
    `warm_up` none of them needs another package."""
    g = torch.Generator().manual_seed(heads)
    n0 = kernel.min_tokens
    kernel.warm_up(heads, kv_heads, 16, torch.float32, scale=0.3)
    packages = dict(kernel.packages)
    assert sum(key[2:4] == (heads, kv_heads) for key in packages) == 1
    with torch.inference_mode():
        for i, (n, cached) in enumerate(((n0, 0), (200, 0), (4 * BLOCK, 0), (4 * BLOCK + 1, 0), (517, 0),
                                         (n0, 16), (264, 16), (4 * BLOCK, 2 * BLOCK), (300, 701))):
            q = (torch.randn(n, heads + 1, 16, generator=g) * 3)[:, 1:]   # strided, as a view of qkv
            k, v = (torch.randn(cached + n, kv_heads, 16, generator=g) * 3 for _ in range(2))
            if i % 2:   # head-major, as `_gather` returns the pool's K/V
                k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k, v))
            if i % 3 == 2:   # a bfloat16 pool's K/V, cast by the kernel
                k, v = k.bfloat16(), v.bfloat16()
            torch.testing.assert_close(kernel(q, k, v, 0.3), _sdpa(q, k.float(), v.float(), 0.3), rtol=1e-5, atol=1e-5)
    assert kernel.packages == packages   # no length, context or layout needed another package


def _generated_code(package) -> str:
    """The C++ inductor wrote for a package (its ``.pt2`` file is a zip holding it)."""
    with zipfile.ZipFile(package.path) as z:
        return "".join(z.read(name).decode() for name in z.namelist() if name.endswith(".cpp"))


def test_the_register_block_goes_to_the_score_micro_gemm_only_and_only_inside_its_context():
    import torch._inductor.compile_fx  # noqa: F401  (import order of inductor's codegen modules)
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    generic, dtypes = cpp_micro_gemm.CppMicroGemmFP32Vec, (torch.float32,) * 4
    one_by_16 = cpp_micro_gemm.GemmBlocking(1, 16, 1)
    with pytest.raises(RuntimeError, match="inside"), qk_register_block() as applied:
        blocked = cpp_micro_gemm.CppMicroGemmFP32Vec
        score = blocked("k_kernel_micro_gemm_transpose_b", *dtypes, one_by_16, 1, True, True)
        pv = blocked("k_kernel_micro_gemm", *dtypes, one_by_16, 1, True, False)
        wide = blocked("k_kernel_micro_gemm_transpose_b", *dtypes, cpp_micro_gemm.GemmBlocking(2, 32, 1), 1, True, True)
        raise RuntimeError("inside")
    assert cpp_micro_gemm.CppMicroGemmFP32Vec is generic   # restored, an error in the build or not
    block = QK_REGISTER_BLOCK.get(pick_vec_isa().bit_width())
    if block is None:   # 256-bit code keeps the template's own score block
        assert tuple(score.register_blocking) == (1, 16, 1) and applied == []
    else:
        assert tuple(score.register_blocking) == (*block, 1) and applied == [block]
    assert tuple(pv.register_blocking) == (1, 16, 1) and tuple(wide.register_blocking) == (2, 32, 1)


def test_a_build_that_asked_for_no_1x16_score_block_is_logged(caplog):
    """A torch whose template no longer asks for the 1 x 16 score block builds the template's own
    kernel, and says so (a warning, not a silent loss of the faster kernel)."""
    import torch._inductor.compile_fx  # noqa: F401  (import order of inductor's codegen modules)
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if pick_vec_isa().bit_width() not in QK_REGISTER_BLOCK:
        pytest.skip("this CPU's vector width has no score register block: nothing to lose")
    dtypes = (torch.float32,) * 4
    with caplog.at_level(logging.WARNING, logger="engine.flex_prefill"):
        with qk_register_block() as applied:
            cpp_micro_gemm.CppMicroGemmFP32Vec("k_kernel_micro_gemm_transpose_b", *dtypes,
                                              cpp_micro_gemm.GemmBlocking(2, 32, 1), 1, True, True)
        assert applied == [] and "template's own register blocks" in caplog.text
        caplog.clear()
        with qk_register_block() as applied:
            cpp_micro_gemm.CppMicroGemmFP32Vec("k_kernel_micro_gemm_transpose_b", *dtypes,
                                              cpp_micro_gemm.GemmBlocking(1, 16, 1), 1, True, True)
        assert applied and not caplog.text


@pytest.mark.parametrize("simdlen", [None, 256], ids=["this-cpu", "256-bit"])
def test_the_score_micro_gemm_is_built_with_the_register_block_of_its_vector_width(simdlen, monkeypatch, tmp_path):
    """The package inductor writes for this CPU's vector width, and for 256-bit vectors (an AVX2
    machine's code, run here), holds the score micro-kernel with the width's register block (1 x
    16, the template's own, for 256-bit code) and every shorter tail of it, the probabilities x V
    one with 1 x 16, and equals SDPA on chunks whose last query block ends on each of those tails,
    and on a 200-token chunk after 16 cached tokens (which 4 x 16 blocks for 256-bit code got
    wrong by 3.4 on a real AVX2 CPU)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # a build of its own, not the cached one
    with inductor_config.patch({"cpp.simdlen": simdlen}):
        width = pick_vec_isa().bit_width()
        assert width == (simdlen or width)
        kernel, g = CompiledPrefill(), torch.Generator().manual_seed(width)
        with torch.inference_mode():
            # the last query block's rows: every remainder by 8, then a chunk after cached context
            for n, cached in [(2 * BLOCK + r, 0) for r in range(1, 9)] + [(300, 701), (200, 16)]:
                q = torch.randn(n, 9, 64, generator=g) * 3
                k, v = (torch.randn(cached + n, 3, 64, generator=g).bfloat16() * 3 for _ in range(2))
                torch.testing.assert_close(kernel(q, k, v), _sdpa(q, k.float(), v.float(), None), rtol=1e-4,
                                           atol=1e-4)
    (package,) = kernel.packages.values()
    code = _generated_code(package)
    rows, cols = QK_REGISTER_BLOCK.get(width, (1, 16))
    for m in range(1, rows + 1):
        assert f"micro_gemm_transpose_b_transpose_b_kernel<{m}, {cols}, accum, prefetch>" in code
    assert f"micro_gemm_transpose_b_transpose_b_kernel<{rows + 1}, " not in code
    assert "_kernel_micro_gemm_kernel<1, 16, accum, prefetch>" in code
    assert f"CPU_CAPABILITY_AVX{'512' if width == 512 else '2'}" in code


class _Calls(CompiledPrefill):
    """The real kernel, recording each prompt length it attends."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def __call__(self, q, k, v, scale=None):
        self.lengths.append(q.shape[0])
        return super().__call__(q, k, v, scale)


def test_paged_attention_sends_the_chunks_it_takes_and_nothing_else():
    """A pass of three prompts (one too short for the kernel), then one of a chunk after cached
    context in the pool, then one with a sliding window: only the long chunks outside a window go
    through the kernel, and every row equals the SDPA path's."""
    kernel = _Calls()
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    lens = (kernel.min_tokens + 10, kernel.min_tokens - 1, kernel.min_tokens + 70)
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 64, kv_heads, bs, dim, generator=g)
    tables = [torch.arange(i * 20, i * 20 + 20) for i in range(3)]

    def both(n, batch, **kw):
        q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
        want = paged_attention(q, k, v, pool[0], pool[1], batch, bs, **kw)
        got = paged_attention(q, k, v, pool[0], pool[1], batch, bs, prefill_kernel=kernel, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    both(sum(lens), ForwardBatch.build([SeqChunk([1] * n, 0, t) for n, t in zip(lens, tables)], bs))
    assert kernel.lengths == [lens[0], lens[2]]
    n = kernel.min_tokens
    both(n, ForwardBatch.build([SeqChunk([1] * n, 40, tables[0])], bs))   # 40 tokens cached
    assert kernel.lengths == [lens[0], lens[2], n]
    both(n, ForwardBatch.build([SeqChunk([1] * n, 40, tables[0])], bs), window=64)
    assert kernel.lengths == [lens[0], lens[2], n]


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
    warm = [kernel.min_tokens, kernel.min_tokens + 2 * BLOCK]
    assert kernel.lengths == warm + [n] * config.num_layers   # the warm-up's calls, then each layer's
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
