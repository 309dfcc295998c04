"""OpenAI response bodies: whole responses, SSE chunks and error bodies."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from router.errors import RouterError


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
