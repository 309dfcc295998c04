"""OpenAI request bodies (pydantic) and their validation into a `GenerationRequest`.

Unknown fields are accepted and ignored. Types, required fields and numeric ranges are declared
on the models, so the published OpenAPI schema says what is valid (schemathesis fuzzes against it);
their violations surface as FastAPI validation errors (400 OpenAI bodies from the API). Semantic
checks raise `InvalidRequest`, `ContextLengthExceeded` or `ModelNotFound` from
`validate_sampling` / `check_lengths`; `validate_sampling` re-checks the ranges too, for models
built in code.
"""

from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from router.errors import ContextLengthExceeded, InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_TOP_K = 2**31 - 1                # the wire's int32; any k >= the vocabulary disables top-k
MAX_LOGPROBS = 20                    # top logprobs per token (OpenAI's top_logprobs limit)
MAX_N = 16                           # choices (n, best_of) per request
LOGIT_BIAS_LIMIT = 100.0             # OpenAI: bias values in [-100, 100]
GREEDY_BELOW = 1e-5                  # temperatures below this mean greedy (vLLM's _SAMPLING_EPS)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# chat_template_kwargs may not name what the renderer sets itself (vLLM also refuses
# chat_template and tokenize), the template helpers, or the renderer's own parameter ``self``.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
    "tokenize", "raise_exception", "strftime_now", "namespace", "self"})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Structured outputs (router/structured.py); checked there, not by the schema.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # Fields that change the output and are not served yet: a 400 rather than a silent ignore.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of one string, a list of token
    ids, or a list of one list of token ids."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class TextPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[dict] | None = None     # an assistant's earlier calls (router/tools.py)
    tool_call_id: str | None = None


class ChatRequest(_SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``. vLLM's
    template fields: ``add_generation_prompt`` (default true), ``continue_final_message`` (the
    prompt ends inside the last message; needs ``add_generation_prompt`` false) and
    ``chat_template_kwargs`` (extra template variables, `chat_template_args`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Lenient):
    """``POST /tokenize`` (vLLM's): ``prompt`` text, or chat ``messages`` rendered with the
    template (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` as
    on chat completions); exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Lenient):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The completion prompt as text or token ids. Raises `InvalidRequest`."""
    p = req.prompt
    if p is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(p, list):
        if len(p) == 0:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        if isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequest("only one prompt per request is supported (batch of "
                                     f"{len(p)} given)", param="prompt")
            p = p[0]
    return p


def chat_messages(req: ChatRequest | list[ChatMessage]) -> list[dict]:
    """Messages (of a request, or a list) as ``[{"role", "content": str}]`` for the chat
    template. Raises `InvalidRequest` (no messages, non-text parts, text that is not valid
    Unicode)."""
    messages = req if isinstance(req, list) else req.messages
    if not messages:
        raise InvalidRequest("'messages' is required and must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(f"messages[{i}]: only text content parts are supported",
                                         param=f"messages.{i}.content")
                texts.append(part.text)
            content = "".join(texts)
        check_unicode(m.role, f"messages.{i}.role")
        check_unicode(content or "", f"messages.{i}.content")
        out.append({"role": m.role, "content": content or ""})
    return out


def check_unicode(text: str, param: str) -> None:
    """Raise `InvalidRequest` unless ``text`` is valid Unicode (JSON lets a lone surrogate such
    as ``"\\ud800"`` through; no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{param} is not valid Unicode: {exc.reason} at position {exc.start}",
                             param=param) from exc


def chat_template_args(req: ChatRequest | TokenizeRequest) -> dict[str, Any]:
    """The keyword arguments of ``Tokenizer.apply_chat_template`` the request sets besides the
    messages and tools: ``add_generation_prompt``, ``continue_final_message`` and the
    ``chat_template_kwargs`` variables (vLLM's request fields).

    Raises `InvalidRequest`: both flags set (``continue_final_message``), ``chat_template_kwargs``
    not an object, naming a `RESERVED_TEMPLATE_VARIABLES` entry, or holding text that is not
    valid Unicode (``chat_template_kwargs``)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt to false)", param="continue_final_message")
    extra = req.chat_template_kwargs or {}
    if not isinstance(extra, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & extra.keys())
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    try:
        json.dumps(extra, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"chat_template_kwargs is not valid Unicode: {exc.reason}",
                             param="chat_template_kwargs") from exc
    return {"add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message, **extra}


def validate_sampling(req: _SamplingFields) -> None:
    """Range checks shared by both endpoints. Raises `InvalidRequest` naming the field.

    NaN and infinities fail every range check (JSON's ``NaN``/``Infinity`` are accepted by the
    parser). A temperature below `GREEDY_BELOW` is valid and means greedy (`effective_temperature`).
    """
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequest(f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and not -1 <= req.top_k <= MAX_TOP_K:
        raise InvalidRequest(f"top_k must be -1, 0 or in [1, {MAX_TOP_K}], got {req.top_k}", param="top_k")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise InvalidRequest(f"min_p must be in [0, 1], got {req.min_p}", param="min_p")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidRequest(f"seed must be in [0, 2**63), got {req.seed}", param="seed")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", param=name)
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= 2.0:
        raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {req.repetition_penalty}",
                             param="repetition_penalty")
    if req.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {req.min_tokens}", param="min_tokens")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                             param="prompt_logprobs")
    _refuse_unserved(req)
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
        check_unicode(s, "stop")
    if isinstance(req, CompletionRequest):
        n = req.n or 1
        if req.best_of is not None and not n <= req.best_of <= MAX_N:
            raise InvalidRequest(f"best_of must be in [n, {MAX_N}] (n = {n}), got {req.best_of}", param="best_of")
        if req.best_of is not None and req.best_of > n and req.stream:
            raise InvalidRequest("best_of > n cannot be streamed", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                                 param="logprobs")
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
    if isinstance(req, ChatRequest):
        chat_template_args(req)
    if isinstance(req, ChatRequest) and req.echo:
        raise InvalidRequest("echo is not supported on chat completions", param="echo")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidRequest("logprobs must be true when top_logprobs is given", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                                 param="top_logprobs")


_UNSERVED = ("functions", "function_call")   # the deprecated forms of tools / tool_choice


def _refuse_unserved(req: _SamplingFields) -> None:
    """A 400 for a field that would change the output and is not served (tools: chat only)."""
    names = _UNSERVED if isinstance(req, ChatRequest) else ("tools", "tool_choice", *_UNSERVED)
    for name in names:
        value = getattr(req, name)
        if value is not None and not (name == "tool_choice" and value == "none"):
            raise InvalidRequest(f"{name} is not supported yet", param=name)


def prompt_logprobs_k(req: _SamplingFields) -> int | None:
    """Top logprobs per prompt token the request needs (vLLM's ``prompt_logprobs``, or
    ``echo`` with ``logprobs`` on completions); None: no prompt logprobs."""
    ks = [req.prompt_logprobs]
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        ks.append(req.logprobs)
    ks = [k for k in ks if k is not None]
    return max(ks) if ks else None


def choice_counts(req: _SamplingFields) -> tuple[int, int]:
    """(choices returned, sequences generated): ``n``, and completions' ``best_of`` (the n with
    the highest cumulative logprob are returned)."""
    n = req.n or 1
    best_of = getattr(req, "best_of", None) or n
    return n, best_of


def requested_logprobs(req: _SamplingFields) -> int | None:
    """How many top logprobs per token the request asks for; None: no logprobs at all."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def token_id_fields(req: _SamplingFields, vocab_size: int) -> tuple[tuple[int, ...], tuple[tuple[int, float], ...]]:
    """``(stop_token_ids, logit_bias pairs)`` of the request, checked against the vocabulary.

    Raises `InvalidRequest`: an id outside ``[0, vocab_size)``, a logit_bias key that is not an
    integer, or a bias outside [-100, 100]."""
    stops = tuple(req.stop_token_ids or ())
    bad = [t for t in stops if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                             param="stop_token_ids")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token {token} outside the vocabulary [0, {vocab_size})",
                                 param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        bias.append((token, float(value)))
    return stops, tuple(sorted(bias))


def effective_temperature(req: _SamplingFields) -> float:
    """The temperature sent to the workers: 1.0 when absent, 0.0 (greedy) below `GREEDY_BELOW`."""
    if req.temperature is None:
        return 1.0
    return 0.0 if req.temperature < GREEDY_BELOW else req.temperature


def stop_strings(req: _SamplingFields) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return tuple(s for s in stops if s)


def with_model_defaults(req: _SamplingFields, defaults) -> _SamplingFields:
    """The request with the model's defaults (``defaults``: an `engine.generation_config.GenerationDefaults`,
    from ``generation_config.json``) in the sampling fields it leaves unset, as vLLM's
    ``--generation-config auto`` applies them: temperature, top_p, top_k, min_p, repetition_penalty.
    A field the request sets wins; max_tokens: `default_max_tokens`."""
    unset = {name: value for name, value in defaults.sampling().items()
             if name in type(req).model_fields and getattr(req, name) is None}
    return req.model_copy(update=unset) if unset else req


def default_max_tokens(chat: bool, defaults, room: int) -> int | None:
    """``check_lengths``' default for a request without max_tokens: completions 16 (OpenAI's);
    chat the model's ``max_new_tokens`` when it is below ``room`` (the context left after the
    prompt), else None (the rest of the context), as vLLM's ``get_max_tokens``."""
    if not chat:
        return DEFAULT_COMPLETION_MAX_TOKENS
    return defaults.max_tokens if defaults.max_tokens is not None and defaults.max_tokens < room else None


def requested_max_tokens(req: _SamplingFields) -> tuple[int | None, str]:
    """(value, field name) of the request's token limit, None when not given."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def check_lengths(num_prompt: int, max_tokens: int | None, param: str, context: int,
                  limit: int, default: int | None) -> int:
    """The request's max_tokens after the context check.

    ``default`` None means "the rest of the context" (at most ``limit``). Raises `InvalidRequest` for an empty
    prompt or max_tokens < 1 / above ``limit``, `ContextLengthExceeded` when prompt + max_tokens
    exceeds ``context``.
    """
    if num_prompt == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if max_tokens is not None and not 1 <= max_tokens <= limit:
        raise InvalidRequest(f"{param} must be in [1, {limit}], got {max_tokens}", param=param)
    if num_prompt >= context:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{num_prompt} tokens", param="prompt")
    if max_tokens is None:   # the default never exceeds the limit either
        max_tokens = min(default if default is not None else context - num_prompt, limit)
    if num_prompt + max_tokens > context:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {context} tokens; the request asks for "
            f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} to generate)",
            param=param)
    return max_tokens

