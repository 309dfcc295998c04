"""Prefill attention of prompt chunks on the CPU through FlexAttention compiled by inductor
(`CompiledPrefill`), the prompt kernel of ``--attention-backend compiled|auto``;
`engine.attention.paged_attention` dispatches to it. Measured against torch's flash SDPA:
docs/PERFORMANCE.md, "Prefill attention through FlexAttention".

FlexAttention (``torch.nn.attention.flex_attention``; Dong et al., "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", 2024) generates the attention
kernel from a mask function and skips the key blocks a block mask marks empty; inductor writes
it as C++ on the CPU (generated code, no kernel of our own), ahead of time (AOTInductor,
`engine.aot_kernel`). Compiled once with dynamic shapes, it serves every prompt length.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from engine.aot_kernel import AotPackage, package_for

BLOCK = 64
"""Rows (queries) and columns (keys) of one block of the causal block mask."""

QK_REGISTER_BLOCK = {512: (8, 16)}
"""By the width in bits of the vector instructions inductor writes for: the register block (query
rows, key columns) of the score micro-GEMM (Q K^T) in the generated FlexAttention kernel, which
inductor's CPU template fixes at 1 x 16 (``CppFlexAttentionTemplate.micro_gemm_define``, torch
2.13), a single accumulator per 16 scores. `qk_register_block` applies it to a build; measured
against 1 x 16: docs/PERFORMANCE.md, "The score micro-kernel of prefill attention". None for
256-bit code (AVX2): 4 x 16 there computed wrong attention on a real AVX2 CPU, though right as
256-bit code on an AVX-512 one (`tests/unit/test_flex_prefill.py` checks the failing chunk;
docs/PERFORMANCE.md, "An AVX2-only EPYC")."""

log = logging.getLogger(__name__)

_QK_MICRO_GEMM = "_kernel_micro_gemm_transpose_b"
"""The name's end of the template's score micro-GEMM (``trans_b``: K read row by row)."""


@contextlib.contextmanager
def qk_register_block():
    """Inductor, inside this context, writes FlexAttention's score micro-GEMM with the register
    block `QK_REGISTER_BLOCK` gives for the vector width it writes for, where the template asks
    for 1 x 16 (a width the table lacks keeps 1 x 16, and so does the other micro-GEMM,
    probabilities times V). The code stays inductor's: its generic micro-GEMM
    (``cpp_micro_gemm.CppMicroGemmFP32Vec``) with a taller block, the rows past a query block's end
    handled by its tail cases. Yields a list that holds, after the build, the register blocks
    applied: empty when the width has none, or when the template no longer asks for a 1 x 16
    score block (then the build is the template's own, and a warning is logged when the context
    exits without an error)."""
    import torch._inductor.compile_fx  # noqa: F401  (first: the codegen modules import each other through it)
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    generic = cpp_micro_gemm.CppMicroGemmFP32Vec
    block = QK_REGISTER_BLOCK.get(pick_vec_isa().bit_width())
    applied: list[tuple[int, int]] = []

    class ScoreBlocked(generic):
        def __init__(self, name, input_dtype, input2_dtype, output_dtype, compute_dtype, register_blocking,
                     alpha=1, tail_n=False, trans_b=False):
            if (block is not None and trans_b and name.endswith(_QK_MICRO_GEMM)
                    and tuple(register_blocking) == (1, 16, 1)):
                register_blocking = cpp_micro_gemm.GemmBlocking(*block, 1)
                applied.append(block)
            super().__init__(name, input_dtype, input2_dtype, output_dtype, compute_dtype, register_blocking,
                             alpha, tail_n, trans_b)

    cpp_micro_gemm.CppMicroGemmFP32Vec = ScoreBlocked
    try:
        yield applied
    finally:
        cpp_micro_gemm.CppMicroGemmFP32Vec = generic
    if block is not None and not applied:
        log.warning("flex_prefill: inductor's FlexAttention template asked for no 1 x 16 score "
                    "micro-GEMM; the package keeps the template's own register blocks")


def causal_block_mask(n: int, ctx: int | None = None, device: torch.device | str = "cpu"):
    """The `BlockMask` of ``n`` queries at positions ``ctx - n .. ctx - 1`` attending causally to
    ``ctx`` keys at positions ``0 .. ctx - 1`` (a prompt chunk after ``ctx - n`` cached tokens;
    ``ctx`` None: ``n``, a whole prompt), built from its block counts, no mask evaluated: query
    block ``i`` reads whole every key block that ends at or before its first query's position,
    and through the mask function the blocks that start at or before its last query's position.
    Blocks are `BLOCK` tokens; the last of each side may be partial (``seq_lengths``).
    Raises ValueError when ``ctx < n``."""
    from torch.nn.attention.flex_attention import BlockMask

    ctx = n if ctx is None else ctx
    if ctx < n:
        raise ValueError(f"{n} queries cannot sit past {ctx} keys")
    offset = torch.tensor(ctx - n, dtype=torch.int64, device=device)

    def causal(b, h, q_idx, kv_idx):   # FlexAttention's mask function: query q_idx sees keys up to its position
        return q_idx + offset >= kv_idx

    nq, nk = -(-n // BLOCK), -(-ctx // BLOCK)
    first_query = (ctx - n) + torch.arange(nq, device=device) * BLOCK      # each query block's first position
    key_end = (torch.arange(nk, device=device) + 1) * BLOCK - 1              # each key block's last position
    full = key_end[None, :] <= first_query[:, None]
    partial = (key_end[None, :] - (BLOCK - 1) <= first_query[:, None] + (BLOCK - 1)) & ~full

    def counts_and_indices(blocks: torch.Tensor):   # [nq, nk] bool -> counts [1, 1, nq], indices [1, 1, nq, nk]
        order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True)   # the marked blocks first, in order
        return (blocks.sum(1).to(torch.int32).view(1, 1, nq),
                order.to(torch.int32).view(1, 1, nq, nk).contiguous())

    return BlockMask.from_kv_blocks(*counts_and_indices(partial), *counts_and_indices(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=causal, seq_lengths=(n, ctx), compute_q_blocks=False)


class CompiledPrefill:
    """Causal attention of a prompt chunk's tokens to themselves and to the sequence's cached
    context before them through FlexAttention compiled ahead of time by AOTInductor
    (`engine.aot_kernel`): one package for every chunk length, context and operand layout (its
    lengths and block counts dynamic, the mask's context offset a tensor input; operands are
    copied head-major), per torch thread count, query dtype, head shape and scale. `warm_up` loads
    it from the disk cache or builds it (`engine.models.llama.LlamaModel.warm_up` calls it at
    start-up, its time logged by the worker); ``packages`` holds them, by key.

    ``min_tokens``: chunks shorter than this go to SDPA instead (`engine.attention.paged_attention`
    asks `takes`): below it the package's call and copies eat the gain (measured:
    docs/PERFORMANCE.md, "Prefill attention through FlexAttention", and for 128 since the kernel
    is a package, "The operators between the matmuls, fused").
    """

    min_tokens = 128
    MASKS = 64
    """Block masks kept by `mask`."""

    def __init__(self) -> None:
        """Raises nothing; inductor's errors (no C++ compiler) come from the call that builds a
        package, which `worker.kernels` turns into a refusal to start or a warning
        (``--attention-backend``)."""
        self._masks: dict[tuple, object] = {}   # (n, ctx, device) -> BlockMask, for a pass's layers
        self._offsets: dict[tuple, torch.Tensor] = {}   # same keys -> the mask's offset, a tensor
        self.packages: dict[tuple, AotPackage] = {}

    def mask(self, n: int, ctx: int, device: torch.device):
        """`causal_block_mask` (``n`` queries over ``ctx`` keys, both in tokens), built once for
        every layer of a pass: up to `MASKS` of them are kept (a pass's chunks), all dropped past
        that. Raises ValueError when ``ctx < n``."""
        key = (n, ctx, str(device))
        mask = self._masks.get(key)
        if mask is None:
            if len(self._masks) >= self.MASKS:
                self._masks.clear()
                self._offsets.clear()
            mask = self._masks[key] = causal_block_mask(n, ctx, device)
            self._offsets[key] = torch.tensor(ctx - n, dtype=torch.int64, device=device)
        return mask

    def package(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device | str,
                scale: float | None) -> AotPackage:
        """The package for queries of ``dtype`` with these head counts and size on the current
        thread count: kept, loaded or built (`engine.aot_kernel.package_for`)."""
        key = (dtype, heads, kv_heads, head_dim, str(device), scale, BLOCK)
        return package_for(self.packages, "flex_prefill", key, [__file__],
                           lambda: _export_prefill(dtype, heads, kv_heads, head_dim, device, scale),
                           codegen=qk_register_block)

    def warm_up(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", scale: float | None = None) -> None:
        """Load or build the package for query tensors ``[n, heads, head_dim]`` and K/V ``[ctx,
        kv_heads, head_dim]`` of ``dtype`` on ``device`` (``scale`` as `__call__`'s) before the
        first prompt, on the current thread count, and run it under ``torch.inference_mode`` as a
        model's forward does: two calls on random rows, the shortest chunk taken after as much
        context, then one of other block counts."""
        with torch.inference_mode():
            for n, ctx in ((self.min_tokens, 2 * self.min_tokens), (self.min_tokens + 2 * BLOCK, 704)):
                self(torch.randn(n, heads, head_dim, dtype=dtype, device=device),
                     *(torch.randn(ctx, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)), scale)

    def takes(self, n: int) -> bool:
        """Whether a prompt chunk of ``n`` tokens goes through this kernel."""
        return n >= self.min_tokens

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Causal attention of ``n`` queries, the last ``n`` of ``ctx`` positions, to all ``ctx``.

        Args:
            q: ``[n, num_heads, head_dim]``; k, v: ``[ctx, num_kv_heads, head_dim]``, ``ctx >= n``
                (the cached context's K/V, then the chunk's; any float dtype, cast to ``q``'s as
                they are copied head-major), ``q`` float32 on the CPU,
                ``num_heads`` a multiple of ``num_kv_heads`` (query head ``h`` reads KV head
                ``h // (num_heads / num_kv_heads)``, Hugging Face's ``repeat_kv``).
            scale: the scores' scale; None: ``head_dim ** -0.5``.
        Returns:
            ``[n, num_heads * head_dim]`` in ``q``'s dtype.
        Raises:
            ValueError: fewer keys than queries.
        """
        (n, heads, dim), ctx = q.shape, k.shape[0]
        if ctx < n:
            raise ValueError(f"{n} queries cannot sit past {ctx} keys")
        # queries from the start of the key block holding the first: the mask's query blocks then
        # line up with its key blocks, one partial block each (the rows before are computed and
        # dropped); every operand contiguous, head-major, whatever layout it came in
        pad = (ctx - n) % BLOCK
        qt = q.new_zeros(1, heads, pad + n, dim)
        qt[0, :, pad:] = q.transpose(0, 1)
        kt, vt = (q.new_empty(1, t.shape[1], ctx, dim).copy_(t.transpose(0, 1)) for t in (k, v))   # cast too
        mask = self.mask(pad + n, ctx, q.device)
        offset = self._offsets[(pad + n, ctx, str(q.device))]
        package = self.package(q.dtype, heads, k.shape[1], dim, q.device, scale)
        o = package(qt, kt, vt, mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                    mask.full_kv_indices, offset)[0]
        return o[0, :, pad:].transpose(0, 1).reshape(n, -1)


class _Prefill(torch.nn.Module):
    """FlexAttention under the causal mask of `causal_block_mask`, rebuilt from its block tensors
    and offset (inputs), with the scale fixed: what `torch.export` takes."""

    def __init__(self, scale: float | None, enable_gqa: bool):
        super().__init__()
        self.scale, self.enable_gqa = scale, enable_gqa

    def forward(self, qt, kt, vt, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, offset):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                        BLOCK_SIZE=BLOCK, mask_mod=causal, seq_lengths=(qt.shape[2], kt.shape[2]),
                                        compute_q_blocks=False)
        return flex_attention(qt, kt, vt, block_mask=mask, scale=self.scale, enable_gqa=self.enable_gqa)


def _export_prefill(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device | str,
                    scale: float | None):
    """`_Prefill` exported on example operands of 320 queries over 704 keys, the query and key
    lengths and the mask's block counts dynamic."""
    n, ctx = 5 * BLOCK, 11 * BLOCK
    mask = causal_block_mask(n, ctx, device)
    args = (torch.zeros(1, heads, n, head_dim, dtype=dtype, device=device),
            *(torch.zeros(1, kv_heads, ctx, head_dim, dtype=dtype, device=device) for _ in range(2)),
            mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
            torch.tensor(ctx - n, dtype=torch.int64, device=device))
    lq, lk = torch.export.Dim("queries", min=2), torch.export.Dim("keys", min=2)
    nq, nk = torch.export.Dim("query_blocks", min=2), torch.export.Dim("key_blocks", min=2)
    return torch.export.export(_Prefill(scale, heads != kv_heads), args,
                               dynamic_shapes=({2: lq}, {2: lk}, {2: lk}, {2: nq}, {2: nq, 3: nk}, {2: nq},
                                               {2: nq, 3: nk}, None))
