"""What the router's API layer hands the orchestrator (`GenerationRequest`) and what it gets
back (`Delta`), shared by `router.orchestrator`, `router.response_bodies` and `router.api`; and
the orchestrator's records of a request: each choice's output (`Choice`) and each placement
(`Attempt`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.errors import UpstreamError
from rpc import pdserve_pb2 as pb

if TYPE_CHECKING:
    from router.clients import DecodeLease
    from router.membership import Member


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. ``stop``: stop strings (the orchestrator matches them); ``max_tokens`` and
    ``min_tokens`` count every generated token including the first; ``logprobs``: top
    logprobs per token (None: none). The rest means what `engine.sampling.SamplingParams` says."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str = ""
    n: int = 1


@dataclass(frozen=True)
class Delta:
    """A piece of output: new token ids and the text safe to show. The last delta of a request
    has ``finish_reason`` ("stop" | "length"); ``completion_tokens`` counts tokens so far;
    ``logprobs``: one per token of ``token_ids`` when the request asked for logprobs;
    ``prompt_logprobs`` (first delta of choice 0, when asked for): one per prompt token after the
    first; ``index``: the choice (n > 1) it belongs to, ``completion_tokens`` counting that choice's."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[pb.TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[pb.TokenLogprobs, ...] | None = None
    index: int = 0


@dataclass
class Choice:
    """Output state of one choice of a request across its attempts (`router.orchestrator`;
    ``failed_workers`` is shared by the request's choices)."""

    req: GenerationRequest
    detok: object
    stop_ids: frozenset[int]
    index: int = 0
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    failed_workers: set[str] = field(default_factory=set)  # tried last on the next attempt
    prompt_sent: bool = False   # prompt logprobs went out with the first delta (choice 0)
    reported: bool = False      # the delta with finish_reason went out

    def add(self, token: int, finish_reason: str | None) -> str:
        """Append a token with the worker's finish reason for it ("" or None: running; the worker
        decides stop tokens, max_tokens and the context, `engine.sequence.token_finish_reason`);
        returns the text now safe to show (never a stop token's). Only stop strings end it here."""
        self.generated.append(token)
        if finish_reason == "stop":   # a stop token
            self.finish_reason = "stop"
            return self.detok.flush()
        text = self.detok.add(token)
        self.finish_reason = "stop" if self.detok.stopped_by is not None else (finish_reason or None)
        if self.finish_reason is not None:
            text += self.detok.flush()
        return text

    def delta(self, text: str, tokens: list[int], logprobs: list[pb.TokenLogprobs] = (),
              prompt_logprobs=None) -> Delta:
        if self.req.logprobs is not None and len(logprobs) != len(tokens):
            raise UpstreamError(f"a worker sent {len(logprobs)} logprobs for {len(tokens)} tokens")
        prompt = None
        if self.req.prompt_logprobs is not None and self.index == 0 and not self.prompt_sent:
            if len(prompt_logprobs or ()) != len(self.req.prompt_token_ids) - 1:
                raise UpstreamError(f"a worker sent {len(prompt_logprobs or ())} prompt logprobs for a "
                                    f"{len(self.req.prompt_token_ids)}-token prompt")
            prompt, self.prompt_sent = tuple(prompt_logprobs), True
        self.reported = self.finish_reason is not None
        return Delta(text, tuple(tokens), self.finish_reason, len(self.req.prompt_token_ids),
                     len(self.generated), tuple(logprobs) if self.req.logprobs is not None else (), prompt,
                     self.index)


class Attempt:
    """One placement of a request (`router.orchestrator`; a retry is a new one, its request id
    suffixed ``~N``): the workers it holds, for release. ``lease``: what the decode worker's
    Reserve answered (None on the colocated path, which reserves nothing)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.decode: Member | None = None
        self.lease: DecodeLease | None = None
        self.prefill: Member | None = None
        self.prefill_tokens = 0
        self.prefill_call: asyncio.Task | None = None
        self.colocated = False
        self.colocated_tokens = 0   # its prompt's, while queued on its decode worker (colocated)
        self.done = False
        self.hashes: list[bytes] | None = None   # the prompt's block hashes (KV-aware policy)
