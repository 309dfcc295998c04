"""Prefill attention of whole prompts on the CPU through FlexAttention compiled by inductor
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


def _causal(b, h, q_idx, kv_idx):
    """FlexAttention mask function: query ``q_idx`` sees keys at or before it."""
    return q_idx >= kv_idx


def causal_block_mask(n: int, device: torch.device | str = "cpu"):
    """The `BlockMask` of causal self-attention over ``n`` tokens, built from its block counts
    (no mask evaluation): query block ``i`` reads key blocks ``0 .. i-1`` whole and block ``i``
    through `_causal`. Blocks are `BLOCK` tokens; the last may be partial (``seq_lengths``)."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-n // BLOCK)
    rows = torch.arange(nb, dtype=torch.int32, device=device)
    cols = rows.expand(nb, nb)
    return BlockMask.from_kv_blocks(
        torch.ones(1, 1, nb, dtype=torch.int32, device=device), rows.view(1, 1, nb, 1).expand(1, 1, nb, nb).contiguous(),
        rows.view(1, 1, nb), cols.view(1, 1, nb, nb).contiguous(), BLOCK_SIZE=BLOCK, mask_mod=_causal,
        seq_lengths=(n, n), compute_q_blocks=False)


class CompiledPrefill:
    """Causal attention of one prompt's tokens to themselves (no cached context) through
    ``torch.compile(flex_attention, dynamic=True)``. Built at its first call (inductor, seconds;
    `engine.models.llama.LlamaModel.warm_up` makes that call at start-up, its time logged by the
    worker) and on disk in inductor's cache for the next start.

    ``min_tokens``: prompts shorter than this go to SDPA instead (`engine.attention.paged_attention`
    asks `takes`): below it the compiled call's fixed cost ate the gain (measured:
    docs/PERFORMANCE.md, "Prefill attention through FlexAttention").
    """

    min_tokens = 192

    def __init__(self) -> None:
        """Raises nothing; inductor's errors (no C++ compiler) come from the first call, which
        `worker.runtime` turns into a refusal to start or a warning (``--attention-backend``)."""
        from torch.nn.attention.flex_attention import flex_attention

        configure_inductor()
        self._flex = torch.compile(flex_attention, dynamic=True)

    def takes(self, n: int) -> bool:
        """Whether a prompt of ``n`` tokens goes through this kernel."""
        return n >= self.min_tokens

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Causal self-attention of ``n`` tokens.

        Args:
            q: ``[n, num_heads, head_dim]``; k, v: ``[n, num_kv_heads, head_dim]``, ``q``'s dtype
                (float32 on the CPU), ``num_heads`` a multiple of ``num_kv_heads`` (query head
                ``h`` reads KV head ``h // (num_heads / num_kv_heads)``, Hugging Face's ``repeat_kv``).
            scale: the scores' scale; None: ``head_dim ** -0.5``.
        Returns:
            ``[n, num_heads * head_dim]`` in ``q``'s dtype.
        """
        n = q.shape[0]
        o = self._flex(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                       block_mask=causal_block_mask(n, q.device), scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return o.squeeze(0).transpose(0, 1).reshape(n, -1)
