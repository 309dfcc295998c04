"""A request's deltas as OpenAI responses: the whole body (`collect`) or SSE chunks (`stream`),
with logprobs, echo, prompt logprobs, tool calls and several choices (``n``, ``best_of``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from router.errors import RouterError
from router.request import Delta, GenerationRequest
from router.responses import (LogprobsBuilder, Shape, merge_logprobs, router_error_body, sse,
                              vllm_prompt_logprobs)
from router.tools import parse_calls


@dataclass(frozen=True)
class Output:
    """What a request's choice shows beyond text: ``logprobs`` of generated tokens; completions
    ``echo`` (``echo_text``: the prompt first; ``echo_logprobs``: its tokens in the logprobs
    object); vLLM's ``prompt_logprobs`` field; tool calls parsed out of the text (a streamed
    answer with tools comes in one chunk at the end, once it is known to be calls or text)."""

    logprobs: bool = False
    echo_text: str | None = None
    echo_logprobs: bool = False
    prompt_logprobs: bool = False
    tool_names: tuple[str, ...] | None = None   # tools in play: the output is parsed for calls
    n: int = 1                                    # choices returned (best_of may generate more)


def _prompt_part(tokenizer, req: GenerationRequest, out: Output, prompt_logprobs,
                 builder: LogprobsBuilder | None) -> tuple[str, dict | None, dict]:
    """(echoed text, echoed logprobs, extra choice fields) that go before a choice's first token."""
    echo_lp = (builder.build_prompt(req.prompt_token_ids, prompt_logprobs)
               if out.echo_logprobs and builder is not None else None)
    extra = ({"prompt_logprobs": vllm_prompt_logprobs(tokenizer, req.prompt_token_ids, prompt_logprobs)}
             if out.prompt_logprobs else {})
    return out.echo_text or "", echo_lp, extra


class _Choice:
    """What the deltas of one choice add up to."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0

    def add(self, d: Delta) -> None:
        self.parts.append(d.text)
        self.tokens += d.token_ids
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason or self.finish_reason
        self.completion_tokens = d.completion_tokens

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def _finish_text(out: Output, text: str, finish: str | None) -> tuple[str | None, str | None, list | None]:
    """(text, finish_reason, tool calls) of a finished choice: tool calls parsed out when tools
    are in play."""
    if out.tool_names is None:
        return text, finish, None
    text, calls = parse_calls(text, out.tool_names)
    return text, ("tool_calls" if calls else finish), calls


async def collect(tokenizer, shape: Shape, req: GenerationRequest, first: Delta,
                  deltas: AsyncIterator[Delta], out: Output) -> dict:
    """The whole response of a request from its deltas (``best_of``: the n best choices)."""
    acc: dict[int, _Choice] = {}
    prompt_lps = first.prompt_logprobs
    acc.setdefault(first.index, _Choice()).add(first)
    async with aclosing(deltas) as it:
        async for d in it:
            acc.setdefault(d.index, _Choice()).add(d)
            prompt_lps = prompt_lps if prompt_lps is not None else d.prompt_logprobs
    order = sorted(acc)
    if len(order) > out.n:   # best_of: the n with the highest cumulative logprob
        order = sorted(order, key=lambda i: -acc[i].cumulative_logprob)[:out.n]
    choices = []
    for new_index, i in enumerate(order):
        c = acc[i]
        builder = LogprobsBuilder(tokenizer, shape.chat) if out.logprobs else None
        echo_text, echo_lp, extra = _prompt_part(tokenizer, req, out, prompt_lps, builder)
        lp = merge_logprobs(echo_lp, builder.build(c.tokens, c.logprobs)) if builder is not None else None
        text, finish, calls = _finish_text(out, echo_text + "".join(c.parts), c.finish_reason)
        choices.append(shape.choice(new_index, text, finish, lp, extra, calls))
    completion = sum(c.completion_tokens for c in acc.values())   # every sequence generated counts
    return shape.full(choices, first.prompt_tokens, completion)


async def stream(tokenizer, metrics, shape: Shape, req: GenerationRequest, first: Delta,
                 deltas: AsyncIterator[Delta], include_usage: bool, out: Output) -> AsyncIterator[str]:
    """SSE chunks: per choice, its opening chunk (chat: the role; completions: echo and prompt
    logprobs), then its deltas (with tools: one chunk once the choice finished), tagged with
    the choice's ``index``; then usage and ``[DONE]``."""
    builders: dict[int, LogprobsBuilder | None] = {}
    buffered: dict[int, _Choice] = {}   # tools: a choice's deltas until it finishes
    completion: dict[int, int] = {}
    prompt_lps = first.prompt_logprobs
    prompt_tokens = first.prompt_tokens
    try:
        async with aclosing(deltas) as it:
            d = first
            while d is not None:
                i = d.index
                prompt_lps = prompt_lps if prompt_lps is not None else d.prompt_logprobs
                if i not in builders:
                    builders[i] = LogprobsBuilder(tokenizer, shape.chat) if out.logprobs else None
                    echo_text, echo_lp, extra = _prompt_part(tokenizer, req, out, prompt_lps, builders[i])
                    if shape.chat:
                        yield sse(shape.chunk("", None, include_usage, role=True, extra=extra, index=i))
                    elif echo_text or extra:
                        yield sse(shape.chunk(echo_text, None, include_usage, logprobs=echo_lp, extra=extra, index=i))
                completion[i] = d.completion_tokens
                builder = builders[i]
                if out.tool_names is not None:   # calls or text: known once the choice finished
                    c = buffered.setdefault(i, _Choice())
                    c.add(d)
                    if d.finish_reason is not None:
                        text, finish, calls = _finish_text(out, "".join(c.parts), c.finish_reason)
                        lp = builder.build(c.tokens, c.logprobs) if builder else None
                        yield sse(shape.chunk(text, finish, include_usage, logprobs=lp, tool_calls=calls, index=i))
                elif d.text or d.finish_reason is not None or (builder and d.token_ids):
                    lp = builder.build(d.token_ids, d.logprobs) if builder else None
                    yield sse(shape.chunk(d.text if (d.text or not shape.chat) else None,
                                          d.finish_reason, include_usage, logprobs=lp, index=i))
                d = await anext(it, None)
        if include_usage:
            yield sse(shape.usage_chunk(prompt_tokens, sum(completion.values())))
        yield sse("[DONE]")
    except RouterError as exc:
        metrics.errors.labels(exc.code or exc.type).inc()
        yield sse(router_error_body(exc))
        yield sse("[DONE]")
    finally:
        metrics.in_flight.dec()
