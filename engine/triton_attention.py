"""Decode attention read straight from the paged KV pool through the block table (a Triton kernel).

One program per (sequence, KV head): the G = num_heads / num_kv_heads query heads that share the
KV head (grouped-query attention, Hugging Face's ``repeat_kv``: query head ``h`` reads KV head
``h // G``) walk the sequence's blocks in order, loading each block's K and V rows from the pool by
the block table (no gathered copy), with an online softmax in float32 (Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018; the same recurrence as FlashAttention and
vLLM's paged attention v1). Options that the engine's families need: a sliding window (the query
at position ``p = len - 1`` reads positions ``> p - window``, Hugging Face's
``kv_idx > q_idx - sliding_window``), a score scale, and Gemma 2's score soft-capping
(``cap * tanh(s / cap)``, before the mask).

Runs where Triton runs: on a CUDA device, and on the CPU under ``TRITON_INTERPRET=1`` (how the
tests check it against the reference in CI; the interpreter reads the environment variable when
this module is imported). The engine calls it for CUDA pools (`engine.attention`); CPU decode
keeps its grouped SDPA path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # the CPU install has no triton; `available` says so
    triton = None


def available(device: torch.device) -> bool:
    """Whether `paged_decode` can run on ``device``: Triton importable, and a CUDA device or the
    interpreter (``TRITON_INTERPRET=1``)."""
    import os

    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr,
                             scale, softcap, window,
                             stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_tb, stride_ob, stride_oh,
                             GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                             HEAD_DIM_P: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
                             WINDOW: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(lens_ptr + seq)
        start = 0
        if WINDOW:
            start = tl.maximum(length - window, 0)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m = tl.full((GROUP_P,), float("-inf"), tl.float32)
        denom = tl.zeros((GROUP_P,), tl.float32)
        acc = tl.zeros((GROUP_P, HEAD_DIM_P), tl.float32)
        for blk in range(start // BLOCK, tl.cdiv(length, BLOCK)):
            block_id = tl.load(table_ptr + seq * stride_tb + blk).to(tl.int64)
            pos = blk * BLOCK + tl.arange(0, BLOCK)
            ok = (pos < length) & (pos >= start)
            rows = tl.arange(0, BLOCK)   # offsets in the block: the pool is [blocks, heads, BLOCK, dim]
            kv_off = block_id * stride_kb + kv_head * stride_kh + rows[:, None] * stride_kt + d[None, :]
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale          # [GROUP_P, BLOCK]
            if SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)      # cap * tanh(s / cap)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its K/V in the pool.

    Args:
        q: ``[B, num_heads, head_dim]`` (float32, bfloat16 or float16).
        k_pool, v_pool: one layer's pool, ``[num_blocks, num_kv_heads, block_size, head_dim]``,
            contiguous in the last dim (any float dtype: read as float32).
        block_tables: ``[B, max_blocks]`` integer block ids; row ``i`` lists sequence ``i``'s
            blocks in position order (entries past its length are not read).
        lens: ``[B]`` integer context lengths in tokens, the new token included (>= 1).
        block_size: tokens per block.
        window: attend to the last ``window`` positions only; None: all.
        scale: score scale; None: ``head_dim ** -0.5``.
        softcap: scores become ``softcap * tanh(s / softcap)`` before the mask; None: no capping.
    Returns:
        ``[B, num_heads, head_dim]`` in ``q``'s dtype.
    Raises:
        RuntimeError: Triton cannot run here (`available` is False).
        ValueError: shapes that do not fit (heads not a multiple of KV heads, head_dim mismatch,
            a block size that is not a power of two, a non-positive window or softcap).
    """
    if not available(q.device):
        raise RuntimeError("paged_decode needs triton and a CUDA device (or TRITON_INTERPRET=1)")
    b, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape[3] != dim or v_pool.shape != k_pool.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_pool.shape)} / {tuple(v_pool.shape)}")
    if block_size & (block_size - 1) or k_pool.shape[2] != block_size:
        raise ValueError(f"block_size={block_size} must be a power of two (a Triton block) and the pool's "
                         f"block dimension ({k_pool.shape[2]})")
    if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
        raise ValueError(f"window={window} and softcap={softcap} must be positive")
    if k_pool.stride(3) != 1 or v_pool.stride() != k_pool.stride() or q.stride(2) != 1:
        raise ValueError("q and the pools must be contiguous in head_dim, and K and V laid out alike")
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(b, kv_heads)](
        q, k_pool, v_pool, block_tables, lens, out,
        float(dim ** -0.5 if scale is None else scale), float(softcap or 1.0), int(window or 0),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=triton.next_power_of_2(group), HEAD_DIM=dim,
        HEAD_DIM_P=triton.next_power_of_2(dim), BLOCK=block_size, SOFTCAP=softcap is not None,
        WINDOW=window is not None)
    return out
