"""OpenAI response bodies: a request's deltas as the whole body (`collect`) or SSE chunks
(`stream`), with logprobs, echo, prompt logprobs, tool calls and several choices (``n``,
``best_of``); the bodies' shapes (`Shape`, `LogprobsBuilder`) and error bodies."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from router.errors import RouterError
from router.request import Delta, GenerationRequest
from router.tools import parse_calls


@dataclass(frozen=True)
class Shape:
    """What distinguishes the two endpoints' bodies."""

    chat: bool
    request_id: str
    model: str
    created: int

    @classmethod
    def new(cls, chat: bool, request_id: str, model: str) -> "Shape":
        return cls(chat, request_id, model, int(time.time()))

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
               extra: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """One choice of a whole response."""
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        choice.update(extra or {})
        return choice

    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        """A whole response; ``completion_tokens`` counts every choice's."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = choices
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: str | None, finish_reason: str | None, include_usage: bool,
              role: bool = False, logprobs: dict | None = None, extra: dict | None = None,
              tool_calls: list[dict] | None = None, index: int = 0) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        choice.update(extra or {})
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body


class LogprobsBuilder:
    """OpenAI ``logprobs`` objects of one choice, built piece by piece (a stream) or at once.

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}], "refusal": null}``. Completions (the legacy shape): ``{"tokens",
    "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, where the top dict
    also holds the chosen token (as vLLM's) and ``text_offset`` counts characters of the
    completion text before each token. A token's text is its bytes decoded as UTF-8 (U+FFFD for
    part of a character; ``bytes`` has the exact ones).

    ``tokenizer``: an `engine.tokenizer.Tokenizer`; ``logprobs`` entries have ``logprob``,
    ``top_token_ids`` and ``top_logprobs`` (``pdserve.v1.TokenLogprobs``).
    """

    def __init__(self, tokenizer, chat: bool):
        self._tok, self._chat, self._offset = tokenizer, chat, 0

    def build_prompt(self, prompt_ids, prompt_logprobs) -> dict:
        """Completions ``echo``: the legacy object for the prompt's tokens (the first has no
        logprob: ``null`` entries), continuing into the generated ones."""
        tk, out = self._tok, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, token in enumerate(prompt_ids):
            text = tk.token_text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            if i == 0:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp = prompt_logprobs[i - 1]
            top = {tk.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            top.setdefault(text, lp.logprob)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
        return out

    def build(self, token_ids, logprobs) -> dict:
        """The object for these tokens (continuing the text offsets of earlier calls)."""
        tk = self._tok
        if self._chat:
            content = []
            for token, lp in zip(token_ids, logprobs):
                top = [{"token": tk.token_text(t), "logprob": v, "bytes": list(tk.token_bytes(t))}
                       for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
                content.append({"token": tk.token_text(token), "logprob": lp.logprob,
                                "bytes": list(tk.token_bytes(token)), "top_logprobs": top})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(token_ids, logprobs):
            text = tk.token_text(token)
            top = {tk.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            top.setdefault(text, lp.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out


def merge_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two legacy completions logprobs objects as one (lists concatenated)."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


def vllm_prompt_logprobs(tokenizer, prompt_ids, prompt_logprobs) -> list:
    """vLLM's ``prompt_logprobs`` choice field: ``None`` for the first prompt token, then per
    token ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the k best and the prompt's
    own token."""
    out: list = [None]
    for token, lp in zip(prompt_ids[1:], prompt_logprobs):
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": tokenizer.token_text(t)}
                 for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entry.setdefault(str(token), {"logprob": lp.logprob, "rank": lp.rank,
                                      "decoded_token": tokenizer.token_text(token)})
        out.append(entry)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def router_error_body(exc: RouterError) -> dict:
    return error_body(exc.message, exc.type, exc.param, exc.code)


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


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
