"""Which prompt chunks a CPU worker's compiled prompt kernel takes, timed at start-up.

`engine.flex_prefill.CompiledPrefill` (FlexAttention compiled ahead of time) and torch's flash SDPA
compute the same causal attention of a prompt chunk; which is faster depends on the CPU. On the
AVX-512 EPYCs the kernel was (docs/PERFORMANCE.md, "Prefill attention through FlexAttention"); on
an AVX2-only EPYC SDPA was faster at every length timed, with or without cached context and on one
thread or two (docs/PERFORMANCE.md, "Prompt attention chosen at start-up"). So a worker started
with ``--attention-backend auto`` times both on its own CPU, as its decode kernel's rows are
timed (`engine.paged_decode.measure_min_rows`), and keeps the kernel only for the lengths it won
(`kernel_from`); ``--attention-backend compiled`` keeps it from its default length, untimed.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.attention import ForwardBatch, SeqChunk, paged_attention
from engine.paged_decode import faster_from

MEASURE_LENGTHS = (128, 256, 512, 1024)
"""Prompt chunk lengths (tokens, no cached context) `measure_prefill_lengths` times."""


def kernel_from(times: dict[int, tuple[float, float]]) -> int | None:
    """The fewest tokens from which the kernel was faster at every longer timed length, by
    ``times`` (chunk length -> (kernel seconds, SDPA seconds)); None when it was not faster at the
    longest (a tie counts for SDPA), or nothing was timed: the decode kernel's rule
    (`engine.paged_decode.faster_from`), with no length taken as the kernel's untimed."""
    never = max(times, default=0) + 1
    start = faster_from(times, never)
    return None if start == never else start


def measure_prefill_lengths(kernel, heads: int, kv_heads: int, head_dim: int, q_dtype: torch.dtype,
                            kv_dtype: torch.dtype, scale: float | None, k_pool: torch.Tensor,
                            v_pool: torch.Tensor, lengths: tuple[int, ...] = MEASURE_LENGTHS,
                            reps: int = 5) -> dict[int, tuple[float, float]]:
    """Time one layer's attention of a fresh prompt chunk of each of ``lengths`` tokens through
    ``kernel`` (a `CompiledPrefill` whose package for the current torch thread count is built or
    loaded, else it is built here) and through SDPA, both by `engine.attention.paged_attention`
    as a prompt pass calls it, under ``torch.inference_mode``, the calls alternated, the first of
    each a warm-up; returns ``{tokens: (kernel seconds, SDPA seconds)}``, medians of ``reps``.

    Args:
        heads, kv_heads, head_dim: the model's attention shape (query heads, K/V heads, width).
        q_dtype: the attention's dtype (the queries'); kv_dtype: the pool's (the chunk's K/V).
        scale: the scores' scale (None: ``head_dim ** -0.5``).
        k_pool, v_pool: one layer's pool ``[num_blocks, num_kv_heads, block_size, head_dim]``,
            at least one block; a fresh chunk attends to its own K/V, so neither is read.
    Raises:
        ValueError: an empty pool, or a length under 1.
    """
    if k_pool.shape[0] < 1:
        raise ValueError("timing the prompt kernel needs a pool of at least one block")
    block_size, gen = k_pool.shape[2], torch.Generator().manual_seed(0)
    times, default = {}, kernel.min_tokens
    kernel.min_tokens = min(default, *lengths)   # the kernel takes every timed chunk
    try:
        with torch.inference_mode():
            for n in lengths:
                if n < 1:
                    raise ValueError(f"a prompt chunk of {n} tokens")
                batch = ForwardBatch.build([SeqChunk([0] * n, 0, [0] * -(-n // block_size))], block_size)
                q = torch.randn(n, heads, head_dim, generator=gen).to(q_dtype)
                k, v = (torch.randn(n, kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2))
                spent = {True: [], False: []}
                for rep in range(reps + 1):
                    for compiled in (True, False) if rep % 2 else (False, True):
                        start = time.perf_counter()
                        paged_attention(q, k, v, k_pool, v_pool, batch, block_size, scale=scale,
                                        prefill_kernel=kernel if compiled else None)
                        if rep:
                            spent[compiled].append(time.perf_counter() - start)
                times[n] = (statistics.median(spent[True]), statistics.median(spent[False]))
    finally:
        kernel.min_tokens = default
    return times


def choose_prefill_lengths(model, kernel, k_pool: torch.Tensor, v_pool: torch.Tensor, threads: int) -> str:
    """Time ``model``'s prompt attention through ``kernel`` (its `CompiledPrefill`, built for
    ``threads``) against SDPA (`measure_prefill_lengths`, on ``threads`` torch threads, the
    count prompt passes run on; the caller's count restored), and keep the kernel for the chunks
    it won: its ``min_tokens`` from `kernel_from`'s length (never below its default), or, where
    it won at none, ``model.prefill_kernel`` set to None (SDPA for every chunk). Returns the
    choice and the times, for the worker's log.

    Args:
        model: an `engine.models.llama.LlamaModel` (its ``config``, ``attn_dtype``, ``kv_dtype``).
        k_pool, v_pool: one layer of its pool, as `measure_prefill_lengths` takes them.
        threads: torch threads to time on (the worker's ``threads``).
    Raises:
        ValueError: as `measure_prefill_lengths` (an empty pool); inductor's errors where the
            kernel's package for ``threads`` is not built and cannot be.
    """
    c, before = model.config, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = measure_prefill_lengths(kernel, c.num_heads, c.num_kv_heads, c.head_dim, model.attn_dtype,
                                        model.kv_dtype, c.attn_scale, k_pool, v_pool)
    finally:
        torch.set_num_threads(before)
    start = kernel_from(times)
    if start is None:
        model.prefill_kernel = None
    else:
        kernel.min_tokens = max(start, kernel.min_tokens)
    choice = "SDPA at every length" if start is None else f"compiled from {kernel.min_tokens} tokens up"
    return f"{choice} (measured on {threads} thread(s): " + ", ".join(
        f"{n} tokens {k * 1e6:.0f} us compiled against {s * 1e6:.0f} us SDPA" for n, (k, s) in times.items()) + ")"
