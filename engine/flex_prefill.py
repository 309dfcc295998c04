"""Prefill attention of prompt chunks on the CPU through FlexAttention compiled by inductor
(`CompiledPrefill`), the prompt kernel of ``--attention-backend compiled|auto``;
`engine.attention.paged_attention` dispatches to it. Measured against torch's flash SDPA:
docs/PERFORMANCE.md, "Prefill attention through FlexAttention".

FlexAttention (``torch.nn.attention.flex_attention``; Dong et al., "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", 2024) generates the attention
kernel from a mask function and skips the key blocks a block mask marks empty; inductor writes
it as C++ on the CPU (generated code, no kernel of our own). Compiled once with dynamic shapes,
it serves every prompt length without recompiling.
"""

from __future__ import annotations

import torch

from engine.paged_decode import configure_inductor

BLOCK = 64
"""Rows (queries) and columns (keys) of one block of the causal block mask."""


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
    context before them through ``torch.compile(flex_attention, dynamic=True)``: one graph for
    every chunk length, context and operand layout (the context offset is a tensor the mask
    function reads; operands are copied head-major), per torch thread count (torch guards on it).
    Built by `warm_up` (inductor, seconds; `engine.models.llama.LlamaModel.warm_up` calls it at
    start-up, its time logged by the worker) and on disk in inductor's cache for the next start.

    ``min_tokens``: chunks shorter than this go to SDPA instead (`engine.attention.paged_attention`
    asks `takes`): below it the compiled call's fixed cost ate the gain (measured:
    docs/PERFORMANCE.md, "Prefill attention through FlexAttention").
    """

    min_tokens = 192
    MASKS = 64
    """Block masks kept by `mask`."""

    def __init__(self) -> None:
        """Raises nothing; inductor's errors (no C++ compiler) come from the first call, which
        `worker.runtime` turns into a refusal to start or a warning (``--attention-backend``)."""
        from torch.nn.attention.flex_attention import flex_attention

        configure_inductor()
        self._flex = torch.compile(flex_attention, dynamic=True)
        self._masks: dict[tuple, object] = {}   # (n, ctx, device) -> BlockMask, for a pass's layers

    def mask(self, n: int, ctx: int, device: torch.device):
        """`causal_block_mask` (``n`` queries over ``ctx`` keys, both in tokens), built once for
        every layer of a pass: up to `MASKS` of them are kept (a pass's chunks), all dropped past
        that. Raises ValueError when ``ctx < n``."""
        key = (n, ctx, str(device))
        mask = self._masks.get(key)
        if mask is None:
            if len(self._masks) >= self.MASKS:
                self._masks.clear()
            mask = self._masks[key] = causal_block_mask(n, ctx, device)
        return mask

    def warm_up(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", scale: float | None = None) -> None:
        """Build the graph(s) for query tensors ``[n, heads, head_dim]`` and K/V ``[ctx,
        kv_heads, head_dim]`` of ``dtype`` on ``device`` (``scale`` as `__call__`'s) before the
        first prompt, on the current thread count, under
        ``torch.inference_mode`` as a model's forward runs: two calls on random rows, the
        shortest chunk taken after as much context, then one of other block counts (the first
        graph holds the block mask's counts fixed; the second, built when they change, takes them
        as dynamic: built here, not at a served prompt)."""
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
        # dropped); every operand contiguous, head-major, whatever layout it came in: one graph
        pad = (ctx - n) % BLOCK
        qt = q.new_zeros(1, heads, pad + n, dim)
        qt[0, :, pad:] = q.transpose(0, 1)
        kt, vt = (q.new_empty(1, t.shape[1], ctx, dim).copy_(t.transpose(0, 1)) for t in (k, v))   # cast too
        o = self._flex(qt, kt, vt, block_mask=self.mask(pad + n, ctx, q.device), scale=scale,
                       enable_gqa=heads != k.shape[1])
        return o[0, :, pad:].transpose(0, 1).reshape(n, -1)
