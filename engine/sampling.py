"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.errors import EngineError, InvalidRequestError

MAX_STOP_STRINGS = 16
# Temperatures below this mean greedy (vLLM's ``_SAMPLING_EPS``): dividing float32 logits by a
# smaller one overflows to inf and the distribution becomes NaN.
SAMPLING_EPS = 1e-5


class SamplingError(EngineError):
    """One row's distribution could not be sampled (non-finite or all-zero probabilities)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Fields:
        max_tokens: tokens to generate at most (>= 1).
        temperature: below ``SAMPLING_EPS`` (1e-5), 0 included, means greedy; otherwise logits
            are divided by it (t <= 100).
        top_p: nucleus sampling mass, 0 < top_p <= 1 (1 disables).
        top_k: keep the k most likely tokens; 0 or -1 disables.
        seed: seed of this request's private random generator (None: random).
        stop: strings that end generation; the text is cut before the first match.
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep going past the model's stop tokens.
    Raises:
        InvalidRequestError: on any out-of-range value.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def make_generator(self) -> torch.Generator | None:
        """The request's private random generator (None for greedy)."""
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int | SamplingError]:
    """Pick one token per row; a row that cannot be sampled does not affect the others.

    Args:
        logits: ``[B, vocab]`` float32.
        params / generators: one per row.
    Returns:
        ``B`` entries: a token id, or the `SamplingError` of a row with a NaN or +inf logit or
        every logit -inf (the caller fails that sequence alone).
    """
    # One pass gives the greedy token and whether the row can be sampled: ``max`` propagates NaN,
    # so the row's maximum is finite exactly when the row has no NaN, no +inf and is not all -inf
    # (-inf entries alone are masked tokens). 3-8x cheaper than argmax plus isfinite().all().
    best, index = logits.max(dim=-1)
    out: list[int | SamplingError] = index.tolist()
    valid = torch.isfinite(best).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not valid[row]:
            out[row] = SamplingError(f"row {row}: the model produced NaN or infinite logits")
        elif not p.greedy:
            out[row] = _sample_row(logits[row], p, gen)
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int | SamplingError:
    scores = logits / p.temperature
    if p.top_k > 0 and p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) > p.top_p  # keep the token that crosses top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = scores.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return SamplingError(f"temperature {p.temperature} gives no valid distribution")
    return int(torch.multinomial(probs, 1, generator=gen).item())
