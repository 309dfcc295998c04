"""Which prompt chunks a CPU worker's compiled prompt kernel takes, timed at start-up.

`engine.flex_prefill.CompiledPrefill` (FlexAttention compiled ahead of time) and torch's flash SDPA
compute the same causal attention of a prompt chunk; which is faster depends on the CPU. On the
AVX-512 EPYCs the kernel was (docs/PERFORMANCE.md, "Prefill attention through FlexAttention"); on
an AVX2-only EPYC SDPA was faster at every length timed, with or without cached context and on one
thread or two (docs/PERFORMANCE.md, "Prompt attention chosen at start-up"). So a worker started
with ``--attention-backend auto`` times both on its own CPU, as its decode kernel's rows are
timed (`engine.paged_decode.measure_min_rows`), and keeps the kernel only for the lengths it won
(`kernel_from`); ``--attention-backend compiled`` keeps it from its default length, untimed.
The timing comes before the kernel's packages for the worker's other thread counts are built
(`worker.kernels`), and times read back need no package at all: a kernel that loses everywhere
costs a first start one package's build, and a restart nothing.
The times are taken once per machine and kept (`engine.tuning.kept_timings`): at some lengths
the two sides lie within the timing's noise, and a choice drawn anew at every start would let
two workers, or one worker before and after a restart, round the same prompt differently. The
decode kernel's rows are timed at every start: its margins were wide wherever it was measured.

Where the pool holds bfloat16 K/V and oneDNN multiplies bfloat16 natively (`prompt_low_dtype`),
SDPA in bfloat16 (the queries rounded to it, the K/V as stored) is timed beside SDPA in the
attention's float32: with AMX, torch's flash kernel runs its products in bfloat16 several times
faster (docs/PERFORMANCE.md, "Prompt attention in bfloat16 on an AMX core"); without it, slower
("Beside vLLM on a Zen 5 core and on a Sapphire Rapids core"). It is taken when faster at every
timed length (`low_precision_wins`), and the kernel is then timed against it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from engine import aot_kernel, attention, flex_prefill
from engine.attention import ForwardBatch, SeqChunk, paged_attention
from engine.linear import bf16_matmul_fast
from engine.paged_decode import faster_from
from engine.tuning import kept_timings

MEASURE_LENGTHS = (128, 256, 512, 1024)
"""Prompt chunk lengths (tokens, no cached context) `measure_prefill_lengths` times."""

_SOURCES = (__file__, attention.__file__, flex_prefill.__file__, aot_kernel.__file__)
"""The modules whose code the kept times depend on (`choose_prefill_lengths`)."""


def kernel_from(times: dict[int, tuple[float, float]]) -> int | None:
    """The fewest tokens from which the kernel was faster at every longer timed length, by
    ``times`` (chunk length -> (kernel seconds, SDPA seconds)); None when it was not faster at the
    longest (a tie counts for SDPA), or nothing was timed: the decode kernel's rule
    (`engine.paged_decode.faster_from`), with no length taken as the kernel's untimed."""
    never = max(times, default=0) + 1
    start = faster_from(times, never)
    return None if start == never else start


def low_precision_wins(times: dict[int, tuple[float, ...]]) -> bool:
    """True when SDPA in the lower precision (each entry's third time) was faster than in the
    attention's own dtype (its second) at every timed length; False for none timed, or a tie."""
    return bool(times) and all(len(t) == 3 and t[2] < t[1] for t in times.values())


def prompt_low_dtype(model) -> torch.dtype | None:
    """bfloat16 where ``model``'s prompt SDPA could run in it at no loss beyond the queries'
    rounding: a CPU model whose pool is bfloat16 (``kv_dtype``), attending in float32
    (``attn_dtype``), on a CPU that multiplies bfloat16 natively; else None (float32 mode, the
    reference, never)."""
    if (model.device.type != "cpu" or model.kv_dtype != torch.bfloat16 or model.attn_dtype != torch.float32
            or not bf16_matmul_fast()):
        return None
    return torch.bfloat16


def measure_prefill_lengths(kernel, heads: int, kv_heads: int, head_dim: int, q_dtype: torch.dtype,
                            kv_dtype: torch.dtype, scale: float | None, k_pool: torch.Tensor,
                            v_pool: torch.Tensor, lengths: tuple[int, ...] = MEASURE_LENGTHS,
                            reps: int = 5, low_dtype: torch.dtype | None = None) -> dict[int, tuple[float, ...]]:
    """Time one layer's attention of a fresh prompt chunk of each of ``lengths`` tokens through
    ``kernel`` (a `CompiledPrefill` whose package for the current torch thread count is built or
    loaded, else it is built here) and through SDPA (and SDPA in ``low_dtype`` when given), each by
    `engine.attention.paged_attention` as a prompt pass calls it, under ``torch.inference_mode``,
    the calls alternated, the first of each a warm-up; returns ``{tokens: (kernel seconds, SDPA
    seconds[, SDPA in low_dtype seconds])}``, medians of ``reps``.

    Args:
        heads, kv_heads, head_dim: the model's attention shape (query heads, K/V heads, width).
        q_dtype: the attention's dtype (the queries'); kv_dtype: the pool's (the chunk's K/V).
        scale: the scores' scale (None: ``head_dim ** -0.5``).
        low_dtype: a lower precision for SDPA (``paged_attention``'s ``prefill_dtype``), or None.
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
                ways = [(kernel, None), (None, None)] + ([(None, low_dtype)] if low_dtype is not None else [])
                spent = [[] for _ in ways]
                for rep in range(reps + 1):
                    for i in range(len(ways)) if rep % 2 else reversed(range(len(ways))):
                        start = time.perf_counter()
                        paged_attention(q, k, v, k_pool, v_pool, batch, block_size, scale=scale,
                                        prefill_kernel=ways[i][0], prefill_dtype=ways[i][1])
                        if rep:
                            spent[i].append(time.perf_counter() - start)
                times[n] = tuple(statistics.median(s) for s in spent)
    finally:
        kernel.min_tokens = default
    return times


def choose_prefill_lengths(model, kernel, k_pool: torch.Tensor, v_pool: torch.Tensor, threads: int,
                           build: Callable[[], object] | None = None) -> str:
    """Time ``model``'s prompt attention through ``kernel`` (its `CompiledPrefill`, built for
    ``threads``, or built by ``build()`` right before it is timed) against SDPA
    (`measure_prefill_lengths`, on ``threads`` torch threads, the count prompt passes run on; the
    caller's count restored), once per machine: the times are
    kept by `engine.tuning.kept_timings` (keyed by the attention's shapes and dtypes, the pool's
    block size, the thread count, the kernel's class and the source of the modules that time
    and run both sides), so later starts read them back and every worker on the machine takes
    the same path for a chunk, and rounds alike. Keeps the kernel for the chunks it won: its
    ``min_tokens`` from `kernel_from`'s length (never below its default), or, where it won at
    none, ``model.prefill_kernel`` set to None (SDPA for every chunk). Where `prompt_low_dtype`
    offers bfloat16, SDPA in it is timed too and, where `low_precision_wins`, taken
    (``model.prefill_attn_dtype``), the kernel then timed against it. Returns the choice, the
    times and where they came from, for the worker's log.

    Where the times are read back, ``build`` is not called: a start that finds SDPA chosen builds
    no prompt kernel at all (`worker.kernels` builds its other thread counts' packages only for a
    kernel that won somewhere).

    Args:
        model: an `engine.models.llama.LlamaModel` (its ``config``, ``attn_dtype``, ``kv_dtype``).
        k_pool, v_pool: one layer of its pool, as `measure_prefill_lengths` takes them.
        threads: torch threads to time on (the worker's ``threads``).
        build: called once, under the tuning directory's lock, before a timing taken now (not
            before times read back): builds or loads ``kernel``'s package for ``threads``.
    Raises:
        ValueError: as `measure_prefill_lengths` (an empty pool); inductor's errors where the
            kernel's package for ``threads`` is not built and cannot be; whatever ``build`` raises.
    """
    c, low = model.config, prompt_low_dtype(model)
    identity = {"threads": threads, "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "q_dtype": str(model.attn_dtype), "kv_dtype": str(model.kv_dtype), "scale": c.attn_scale,
                "block_size": k_pool.shape[2], "lengths": list(MEASURE_LENGTHS), "low_dtype": str(low),
                "kernel": f"{type(kernel).__module__}.{type(kernel).__qualname__}"}
    width = 2 if low is None else 3

    def measure() -> dict:
        if build is not None:
            build()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            times = measure_prefill_lengths(kernel, c.num_heads, c.num_kv_heads, c.head_dim, model.attn_dtype,
                                            model.kv_dtype, c.attn_scale, k_pool, v_pool, low_dtype=low)
        finally:
            torch.set_num_threads(before)
        return {"times": {str(n): list(ways) for n, ways in times.items()}}

    def check(entry: dict) -> None:
        kept = entry["times"]
        if sorted(map(int, kept)) != sorted(MEASURE_LENGTHS):
            raise ValueError(f"'times' holds lengths {sorted(kept)}, not {list(MEASURE_LENGTHS)}")
        if not all(len(ways) == width and all(type(t) is float and t > 0 for t in ways) for ways in kept.values()):
            raise ValueError(f"'times' {kept} are not {width}-tuples of seconds")

    entry, how = kept_timings("prompt-attention", identity, _SOURCES, measure, check)
    times = {int(n): tuple(ways) for n, ways in entry["times"].items()}
    model.prefill_attn_dtype = low if low_precision_wins(times) else None
    low_name = str(low).removeprefix("torch.")
    sdpa = "SDPA" if model.prefill_attn_dtype is None else f"SDPA in {low_name}"
    start = kernel_from({n: (ways[0], ways[2] if model.prefill_attn_dtype is not None else ways[1])
                         for n, ways in times.items()})
    if start is None:
        model.prefill_kernel = None
    else:
        kernel.min_tokens = max(start, kernel.min_tokens)
    choice = f"{sdpa} at every length" if start is None else f"compiled from {kernel.min_tokens} tokens up, {sdpa} below"
    return f"{choice} (measured on {threads} thread(s): " + ", ".join(
        f"{n} tokens {ways[0] * 1e6:.0f} us compiled against {ways[1] * 1e6:.0f} us SDPA"
        + (f" and {ways[2] * 1e6:.0f} us SDPA in {low_name}" if len(ways) == 3 else "")
        for n, ways in sorted(times.items())
    ) + f"; {how})"
