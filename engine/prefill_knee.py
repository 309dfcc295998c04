"""The prompt tokens a CPU worker's pass holds before batching more stops paying, timed once per machine.

`engine.scheduling`'s second rule batches queued prompts into one pass only up to the device's
throughput knee (``batch_tokens``): past it a larger pass adds little to tokens/s and only makes
the pass's earlier prompts wait for its later ones. Where the knee lies depends on the core and
the weights' dtype: float32 matmuls on an AVX-512 core without AMX come near their peak in far
smaller passes than bfloat16 matmuls on AMX tiles (measured: docs/PERFORMANCE.md, "Prefill
scheduling" and "The prefill knee timed per machine"). So a CPU
worker started without ``--prefill-batch-tokens`` times it (`choose_batch_tokens`): passes of
1, 2, 4 and 8 prompts of `PROMPT_TOKENS` tokens each (`KNEE_SIZES`, as the scheduler batches them:
separate sequences, each attending to itself), on the worker's thread count, through the
model's kernels as the worker built them; the knee (`knee_from`) is the smallest pass whose
tokens/s is within `KNEE_FRACTION` of the best. The rates are kept per machine
(`engine.tuning.kept_timings`), so a restart, and the other workers of the host, read them back
rather than timing again.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.kv_cache import KVPool, blocks_needed

PROMPT_TOKENS = 128
"""Tokens of each prompt of a timed pass."""

KNEE_SIZES = (128, 256, 512, 1024)
"""Prompt tokens of the timed passes (1, 2, 4 and 8 prompts of `PROMPT_TOKENS`)."""

KNEE_FRACTION = 0.9
"""The knee: the smallest pass whose tokens/s reaches this fraction of the best timed pass's."""

REPS = 3
"""Timed passes of each size (after one untimed), sizes alternated; the median is kept."""


def knee_from(rates: dict[int, float], fraction: float = KNEE_FRACTION) -> int:
    """The smallest pass size (tokens) in ``rates`` (size -> prompt tokens/s) whose rate is at
    least ``fraction`` of the highest.

    Raises:
        ValueError: ``rates`` is empty, holds a rate that is not positive, or ``fraction`` is not
            in (0, 1].
    """
    if not rates:
        raise ValueError("no pass rates to find a knee in")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if min(rates.values()) <= 0:
        raise ValueError(f"pass rates must be positive, got {rates}")
    best = max(rates.values())
    return min(size for size, rate in rates.items() if rate >= fraction * best)


def measure_pass_rates(model, pool: KVPool, sizes: tuple[int, ...] = KNEE_SIZES,
                       reps: int = REPS) -> dict[int, float]:
    """Prompt tokens/s of a pass of ``size // PROMPT_TOKENS`` prompts of `PROMPT_TOKENS` random
    tokens each, for each of ``sizes`` that ``pool`` has the free blocks for, on the current
    torch thread count: the median of ``reps`` passes after one untimed (sizes alternated, so
    a slower moment spreads over all of them). The blocks taken are given back.

    Args:
        model: an `engine.models.llama.LlamaModel` (``forward(batch, pool)``).
        pool: the worker's KV pool, its blocks free (the worker's start-up).
    Raises:
        ValueError: a size is not a positive multiple of `PROMPT_TOKENS`; ``pool`` cannot hold
            the smallest size's prompts.
    """
    if any(s < PROMPT_TOKENS or s % PROMPT_TOKENS for s in sizes):
        raise ValueError(f"pass sizes must be positive multiples of {PROMPT_TOKENS}, got {sizes}")
    per_prompt = blocks_needed(PROMPT_TOKENS, pool.block_size)
    fit = [s for s in sizes if s // PROMPT_TOKENS * per_prompt <= pool.allocator.num_free]
    if not fit:
        raise ValueError(f"the KV pool's {pool.allocator.num_free} free blocks cannot hold a pass of "
                         f"{min(sizes)} prompt tokens")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    spent: dict[int, list[float]] = {s: [] for s in fit}
    for rep in range(reps + 1):
        for size in fit if rep % 2 else reversed(fit):
            tables = [pool.allocator.allocate(per_prompt) for _ in range(size // PROMPT_TOKENS)]
            try:
                chunks = [SeqChunk(torch.randint(vocab, (PROMPT_TOKENS,), generator=gen).tolist(), 0, t)
                          for t in tables]
                batch = ForwardBatch.build(chunks, pool.block_size)
                start = time.perf_counter()
                model.forward(batch, pool)
                if rep:
                    spent[size].append(time.perf_counter() - start)
            finally:
                for t in tables:
                    pool.allocator.free(t)
    return {s: s / statistics.median(times) for s, times in spent.items()}


def choose_batch_tokens(model, pool: KVPool, threads: int, weights: str, max_tokens: int) -> tuple[int, str]:
    """The knee (`knee_from`) of ``model``'s pass rates on ``threads`` torch threads
    (`measure_pass_rates`; the caller's count restored), at most ``max_tokens``, and a line for
    the worker's log (the rates and where they came from). The rates are kept per machine by
    `engine.tuning.kept_timings`, keyed by the model's config, ``weights`` (the resolved mode),
    its dtypes and prompt-attention choice, the pool's block size, the thread count, the sizes
    and the source of this module and of the modules a pass runs through. A pool whose free
    blocks cannot hold the largest timed pass is not timed in: the CPU default then
    (`engine.scheduling.default_batch_tokens`).

    Raises:
        whatever ``model.forward`` raises while timing (the rates are then not kept).
    """
    from engine import attention, tuning
    from engine.models import llama
    from engine.scheduling import default_batch_tokens

    need = max(KNEE_SIZES) // PROMPT_TOKENS * blocks_needed(PROMPT_TOKENS, pool.block_size)
    if pool.allocator.num_free < need:
        knee = default_batch_tokens("cpu", max_tokens)
        return knee, f"{knee} tokens (the CPU default: not timed, the KV pool's {pool.allocator.num_free} " \
                     f"free blocks cannot hold a pass of {max(KNEE_SIZES)} prompt tokens)"

    identity = {"threads": threads, "model": repr(model.config), "weights": weights, "dtype": str(model.dtype),
                "kv_dtype": str(model.kv_dtype), "prompt_attention": str(getattr(model, "prefill_attn_dtype", None)),
                "block_size": pool.block_size, "sizes": list(KNEE_SIZES), "prompt_tokens": PROMPT_TOKENS}

    def measure() -> dict:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                rates = measure_pass_rates(model, pool)
        finally:
            torch.set_num_threads(before)
        return {"rates": {str(s): r for s, r in rates.items()}}

    def check(entry: dict) -> None:
        rates = entry["rates"]
        if sorted(map(int, rates)) != sorted(KNEE_SIZES) or not all(type(r) is float and r > 0 for r in rates.values()):
            raise ValueError(f"'rates' {rates} are not tokens/s of the sizes {list(KNEE_SIZES)}")

    entry, how = tuning.kept_timings("prefill-knee", identity, (__file__, attention.__file__, llama.__file__),
                                     measure, check)
    rates = {int(s): r for s, r in entry["rates"].items()}
    knee = min(knee_from(rates), max_tokens)
    shown = ", ".join(f"{s} tokens {r:.0f}/s" for s, r in sorted(rates.items()))
    return knee, f"{knee} tokens (prompt tokens/s on {threads} thread(s), passes of {PROMPT_TOKENS}-token " \
                 f"prompts: {shown}; {how})"
