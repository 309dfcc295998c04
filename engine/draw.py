"""Inverse transform sampling over a vocabulary: `draw` (one row over its cumulative sum) and
`draw_rows` (several rows at once, in two levels, without the whole running sum); the sampler
(`engine.sampling.sample`) calls them."""

from __future__ import annotations

import threading

import torch

DRAW_CHUNK = 256
"""Vocabulary entries per chunk of `draw_rows`' two-level search."""
DRAW_ROWS_MIN = 8
"""`engine.sampling.sample` draws its plain temperature rows together (`draw_rows`) from this
many; fewer are drawn one at a time, where the shared passes' fixed cost outweighs what they
save (measured: ``python -m bench.sampling``, docs/PERFORMANCE.md "Sampled rows drawn
together")."""


def draw_rows(logits: torch.Tensor, best: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperature)``, by inverse transform sampling
    in two levels: the row's unnormalised probabilities ``exp((logits - best) / temperature)``
    (each row's largest is 1, so the total is at least 1), their sums over chunks of
    `DRAW_CHUNK` tokens, the chunk where the running sum of those passes ``u`` times the total,
    then the token inside it; the same draw as `draw` over the whole row's cumulative sum
    without computing it (a running sum is the one step of a draw that does not vectorise).
    A token of probability 0 (a -inf logit) is never picked.

    Args:
        logits: ``[R, vocab]`` float32, finite row maxima (`engine.sampling.sample` checks them).
        best: ``[R]`` float32, each row's maximum.
        temperatures: ``[R]`` float32, each > 0.
        u: ``[R]`` float32, uniform in ``[0, 1)``.
    Returns:
        ``[R]`` int64 token ids.
    """
    rows, vocab = logits.shape
    chunks = _scratch(rows, -(-vocab // DRAW_CHUNK) * DRAW_CHUNK).view(rows, -1, DRAW_CHUNK)
    weights = chunks.view(rows, -1)
    torch.sub(logits, best[:, None], out=weights[:, :vocab])
    weights[:, vocab:] = float("-inf")   # padding to whole chunks: weight 0
    if bool((temperatures != 1.0).any()):
        weights.div_(temperatures[:, None])
    weights.exp_()
    running = chunks.sum(-1).cumsum_(-1)                                 # [R, chunks]
    total = running[:, -1:]
    # u * total can round up to the total: stay below it, so the chunk found holds a weight
    target = torch.minimum(u[:, None] * total, total * (1 - 2**-20))
    chunk = torch.searchsorted(running, target, right=True).clamp_(max=running.shape[1] - 1)
    before = torch.where(chunk > 0, running.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    inside = chunks.gather(1, chunk[:, :, None].expand(rows, 1, DRAW_CHUNK)).squeeze(1).cumsum_(-1)
    # the chunk's own running sum rounds apart from the chunk sums: keep the target inside
    # (0 .. its last running sum), where the first entry above it has a weight
    target = torch.minimum((target - before).clamp_(min=0.0), inside[:, -1:] * (1 - 2**-20))
    position = torch.searchsorted(inside, target, right=True).clamp_(max=DRAW_CHUNK - 1)
    return (chunk * DRAW_CHUNK + position).squeeze(1)


_SCRATCH = threading.local()


def _scratch(rows: int, columns: int) -> torch.Tensor:
    """A float32 ``[rows, columns]`` buffer of the calling thread, kept between calls: a draw's
    weights are as large as the logits, and a fresh allocation of that size costs the CPU about
    as much as a pass over it (the pages are faulted in again)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < rows * columns:
        buf = _SCRATCH.buf = torch.empty(rows * columns)
    return buf[:rows * columns].view(rows, columns)


def draw(cdf: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse transform sampling: the first index whose cumulative probability exceeds ``u``.

    Args:
        cdf: ``[vocab]`` float32, the running sum of the probabilities (non-decreasing).
        u: ``[1]`` float32, uniform in ``[0, cdf[-1])``.
    A token of probability 0 is never picked (its ``cdf`` entry equals the one before, so no
    ``u`` falls in its interval). The same draw as ``torch.multinomial(probs, 1)`` computes
    internally, at a fraction of its cost for a large vocabulary (measured: docs/PERFORMANCE.md,
    "Sampling")."""
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
