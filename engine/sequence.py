"""A request's state inside a generator: tokens, blocks, progress and finish reason.

Lifecycle: WAITING (queued; prompt KV not yet computed) -> RUNNING (in the decode batch) ->
FINISHED (blocks released). A preempted sequence goes back to WAITING with its blocks freed and
is recomputed from prompt + generated tokens. FINISHED is absorbing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.ids import BlockId, RequestId
from engine.sampling import SamplingParams


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the values are the OpenAI ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"    # this sequence alone failed (e.g. its logits could not be sampled)


def token_finish_reason(token: int, stop_token_ids: frozenset[int], num_output: int, max_tokens: int,
                        num_tokens: int, max_position: int) -> FinishReason | None:
    """Why the token just generated ends its sequence, or None: the one rule every worker applies
    (the router only adds stop strings).

    STOP when ``token`` is a stop token (EOS or the request's ``stop_token_ids``; the sampler
    cannot draw one before ``min_tokens``); else LENGTH when ``num_output`` (output tokens of
    this run, ``token`` included) reaches ``max_tokens``, or ``num_tokens`` (prompt + output)
    reaches the model's context ``max_position``.
    """
    if token in stop_token_ids:
        return FinishReason.STOP
    if num_output >= max_tokens or num_tokens >= max_position:
        return FinishReason.LENGTH
    return None


@dataclass
class Sequence:
    """One request inside the generator.

    Attributes:
        num_computed: tokens of `all_token_ids` whose K/V are in the pool.
        block_table: blocks holding this sequence's K/V, in position order.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[BlockId] = field(default_factory=list)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    detokenizer: object | None = None
    text: str = ""
    prompt_logprobs: list | None = None   # `TokenLogprobs` gathered over the prompt's chunks
    matcher: object | None = None         # `engine.grammar.Matcher` when params.grammar is set
    block_hashes: list = field(default_factory=list)   # prefix caching: hashes of the full blocks
    num_registered: int = 0               # leading blocks registered in the prefix cache
    parent: RequestId | None = None       # the request (n > 1: one of its choices); None: itself
    index: int = 0                        # choice index within the request
    queued_at: float = field(default_factory=time.monotonic)   # seconds (monotonic), for HRRN

    @property
    def request(self) -> RequestId:
        """The request this sequence belongs to."""
        return self.parent if self.parent is not None else self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def finish(self, reason: FinishReason) -> None:
        if self.status != SeqStatus.FINISHED:
            self.status = SeqStatus.FINISHED
            self.finish_reason = reason
