"""Which queued prompts are computed next, and how many share one forward pass.

A prefill's whole output is its first token, so a prompt's TTFT ends with the pass that computes
its last chunk, and every prompt of a pass finishes when the pass does. Two rules follow:

1. **Order: highest response ratio next** (HRRN; P. Brinch Hansen, "Short-term scheduling in
   multiprogramming systems", SOSP 1971). A queued prompt's ratio is
   ``(waited + service) / service``, ``service`` = its tokens still to compute (less the blocks the prefix cache holds now) / the
   worker's measured prefill rate. Prompts that arrive together run shortest first, which is
   what minimises their mean TTFT (shortest-remaining-first); a long prompt's ratio grows while
   it waits, so a stream of short ones cannot starve it (its slowdown is bounded). FIFO, vLLM's
   default, makes each prompt of a burst wait for every longer one queued ahead of it.
2. **Batch size: stop at the throughput knee.** Batching prompts into one pass raises tokens/s
   only until the pass fills the device; past that point it only makes the earlier prompts wait
   for the later ones. The first prompt in ratio order takes up to ``max_num_batched_tokens``
   (longer ones are chunked); the next ones join whole while the pass stays within
   ``batch_tokens``; the first that does not fit closes the pass. Joining whole rather than with
   a chunk of what is left measured better on the bursts of ``bench.prefill.burst`` (a chunked
   prompt finishes a pass later anyway, and delays the pass it rides in). Where the knee lies
   depends on the core and the weights' dtype (docs/PERFORMANCE.md, "Prefill scheduling" and
   "The prefill knee timed per machine"), so a CPU worker times it at start-up (`engine.prefill_knee`) and
   `CPU_BATCH_TOKENS` (128) is only the default where it is not timed; on a GPU the knee lies
   near the chunk size (vLLM and Sarathi-Serve's token budgets of 512-2048), so the default
   there is ``max_num_batched_tokens``: one pass as before.

`PassBudget`, `by_response_ratio` and `fill_pass` are pure; the prefill worker
(`prefill.worker.PrefillWorker`) and the generator (`engine.generator.Generator`, the prompts of
colocated and auto modes, where a pass also carries the running sequences' decode rows; a decode
worker gives it ``max_num_batched_tokens`` as its ``batch_tokens``: `worker.config`) both choose
their passes' prompts with `fill_pass`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

CPU_BATCH_TOKENS = 128   # the CPU knee where it is not timed (module doc, rule 2)

J = TypeVar("J")


def default_batch_tokens(device: str, max_num_batched_tokens: int) -> int:
    """``batch_tokens`` when the worker is not given one: `CPU_BATCH_TOKENS` on the CPU (at most
    ``max_num_batched_tokens``), ``max_num_batched_tokens`` on CUDA (module doc, rule 2)."""
    return min(CPU_BATCH_TOKENS, max_num_batched_tokens) if device == "cpu" else max_num_batched_tokens


def by_response_ratio(jobs: Iterable[J], now: float, tokens_per_s: float,
                      queued_at: Callable[[J], float], remaining: Callable[[J], int]) -> list[J]:
    """``jobs`` highest response ratio first (module doc, rule 1); equal ratios keep their order.

    Args:
        now, queued_at(job): monotonic seconds.
        tokens_per_s: the prefill rate that turns tokens into service seconds (> 0).
        remaining(job): prompt tokens the job still has to compute (>= 1).
    Raises ValueError when ``tokens_per_s`` is not positive.
    """
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")

    def ratio(job: J) -> float:   # (w + s) / s = 1 + w * rate / tokens
        return 1.0 + max(0.0, now - queued_at(job)) * tokens_per_s / max(1, remaining(job))

    return sorted(jobs, key=ratio, reverse=True)   # sorted() is stable


class PassBudget:
    """Tokens the prompts of one forward pass may take (module doc, rule 2).

    The first prompt takes up to ``max_tokens`` (a longer one is chunked); a later prompt joins
    only whole, and only while the pass then holds at most ``batch_tokens``; the first that does
    not fit closes the pass (nobody behind it overtakes it). With ``batch_tokens`` None the pass
    is filled instead: every prompt takes what is left of ``max_tokens``, the last one chunked.
    Raises ValueError unless ``1 <= batch_tokens`` (or None) and ``1 <= max_tokens``.
    """

    def __init__(self, max_tokens: int, batch_tokens: int | None):
        if max_tokens < 1 or (batch_tokens is not None and batch_tokens < 1):
            raise ValueError(f"max_tokens {max_tokens} and batch_tokens {batch_tokens} must be >= 1")
        self.max_tokens = max_tokens
        self.fill = batch_tokens is None
        self.batch_tokens = max_tokens if batch_tokens is None else min(batch_tokens, max_tokens)
        self.used = 0
        self.full = False   # no other prompt may join this pass

    def take(self, remaining: int) -> int:
        """Tokens of a prompt with ``remaining`` (>= 1) uncomputed ones that go into this pass,
        counted as taken; 0 when it does not join (the pass is then `full`)."""
        if self.full:
            return 0
        if self.used == 0 or self.fill:
            n = min(remaining, self.max_tokens - self.used)
        elif self.used + remaining <= self.batch_tokens:
            n = remaining
        else:
            n = 0
        self.used += n
        self.full = n == 0 or self.used >= self.batch_tokens
        return n


def fill_pass(candidates: Iterable[J], budget: PassBudget, remaining: Callable[[J], int],
              admit: Callable[[J, int], bool]) -> list[tuple[J, int]]:
    """The prompts of one pass and how many tokens each computes in it, in ``candidates`` order.

    Each candidate takes ``budget.take(remaining(c))`` tokens; ``admit(c, tokens)`` then gives it
    what it needs to run them (blocks); a candidate the budget or ``admit`` turns away closes the
    pass (nobody behind it overtakes it), and so does a chunked one. This is the one place the
    prefill worker and the generator decide a pass's prompts.
    """
    out: list[tuple[J, int]] = []
    for c in candidates:
        left = remaining(c)
        take = budget.take(left)
        if not take or not admit(c, take):
            break
        out.append((c, take))
        if take < left or budget.full:
            break
    return out


class RateMeter:
    """Prefill tokens/s, an exponentially weighted mean over passes (weight ``alpha`` on the
    newest); starts at ``initial`` (tokens/s) before the first pass is measured."""

    def __init__(self, initial: float = 500.0, alpha: float = 0.2):
        self.tokens_per_s = initial
        self.alpha = alpha

    def add(self, tokens: int, seconds: float) -> None:
        """Record one pass: ``tokens`` computed in ``seconds`` (ignored when either is <= 0)."""
        if tokens > 0 and seconds > 0:
            self.tokens_per_s += self.alpha * (tokens / seconds - self.tokens_per_s)
