"""The OpenAI-compatible HTTP API (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE
``data: {...}`` chunks ending with ``data: [DONE]``, or whole; logprobs in OpenAI's shapes),
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's; lm-evaluation-harness's
remote tokenizer uses them), ``GET /v1/models`` (with ``max_model_len``),
``GET /health`` (200 when at least one prefill and one decode worker are connected, or in the
colocated and auto serving modes one decode worker, else 503),
``GET /metrics`` (Prometheus), ``GET /admin/workers`` (members; ``?stats=1`` adds each worker's
``Stats``).

Every error is an OpenAI body ``{"error": {"message", "type", "param", "code"}}``: validation
problems (malformed JSON, values out of range, text that is not valid Unicode) are 400, a body
over ``max_request_bytes`` 413, an unknown model 404, no workers or no capacity 503 with
``Retry-After`` (a full admission queue answers at once, `router.admission`), workers failing a
request on every attempt 502. A streamed request fails with an HTTP status when it fails before
its first token; after that the error arrives as a ``data: {"error": ...}`` event before
``[DONE]``. Prompts are refused before tokenizing when even their byte length shows they cannot
fit the context; chat templates render and long texts tokenize off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError
from router.config import RouterConfig
from router.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, RequestTooLarge, RouterError
from router.membership import Membership
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.policy import make_policy
from router.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, chat_messages,
                             chat_template_args, check_lengths, check_unicode, choice_counts, default_max_tokens,
                             effective_temperature, prompt_logprobs_k, prompt_of, requested_logprobs,
                             requested_max_tokens, stop_strings, token_id_fields, validate_sampling,
                             with_model_defaults)
from router.request import Delta, GenerationRequest
from router.response_bodies import Output, Shape, collect, error_body, router_error_body, stream
from router.serving import healthy
from router.structured import constrained, grammar_of
from router.tools import plan_tools, render_messages

log = logging.getLogger(__name__)

_OFFLOAD_CHARS = 16_384  # tokenize longer prompts off the event loop


@dataclass
class RouterState:
    """What the routes need. ``context_length`` in tokens; ``model_root`` is the model path
    reported as ``root`` by /v1/models."""

    config: RouterConfig
    tokenizer: object
    context_length: int
    membership: Membership
    orchestrator: Orchestrator
    metrics: RouterMetrics
    model_root: str


def build_state(config: RouterConfig, tokenizer, context_length: int, membership: Membership,
                model_root: str, metadata: tuple = ()) -> RouterState:
    """Wire the orchestrator, policy and metrics. ``metadata``: sent with every worker call."""
    metrics = RouterMetrics(membership)
    policy = make_policy(config.policy, membership.kv_index, config.kv_overlap_weight, config.kv_decode_overlap_weight)
    orch = Orchestrator(config, membership, tokenizer, policy, metrics, metadata)
    return RouterState(config, tokenizer, context_length, membership, orch, metrics, model_root)


def create_app(state: RouterState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await state.orchestrator.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.router = state
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=state.config.max_request_bytes)
    app.add_middleware(RefuseWhenFull, state=state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _serve(state, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await _serve(state, body, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(state, body.model)
        tk = state.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            messages = chat_messages(body.messages)
            args = chat_template_args(body)
            try:
                text = await asyncio.to_thread(tk.apply_chat_template, messages, **args)
            except InvalidRequestError as exc:
                raise InvalidRequest(str(exc), param="messages") from exc
        else:
            text = body.prompt
            check_unicode(text, "prompt")
        ids = await _encode(tk, text)
        if not body.add_special_tokens and tk.add_bos and ids[:1] == [tk.bos_token_id]:
            ids = ids[1:]
        return {"count": len(ids), "max_model_len": state.context_length, "tokens": ids,
                "token_strs": [tk.token_text(t) for t in ids] if body.return_token_strs else None}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tk = state.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tk.eos_token,
                "bos_token": tk.bos_token or None, "pad_token": None, "chat_template": tk.chat_template,
                "model_max_length": state.context_length, "add_bos_token": tk.add_bos}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(state, body.model)
        tk = state.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < tk.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids out of range [0, {tk.vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": tk.decode(body.tokens)}

    @app.get("/v1/models")
    async def models():
        name = state.config.served_model_name
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "pdserve",
            "root": state.model_root, "parent": None, "max_model_len": state.context_length}]}

    @app.get("/health")
    async def health():
        members = state.membership.members()
        counts = {role: sum(1 for m in members if m.role == role and m.routable)
                  for role in ("prefill", "decode")}
        ok = healthy(state.config.serving_mode, counts["prefill"], counts["decode"])
        body = {"status": "ok" if ok else "unavailable", **counts,
                "members": {m.worker_id: m.state.name for m in members}}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/workers")
    async def workers(stats: bool = False):
        members = state.membership.members()
        out = [m.as_json() for m in members]
        if stats:
            replies = await asyncio.gather(*(state.orchestrator.stats(m) for m in members),
                                           return_exceptions=True)
            for entry, reply in zip(out, replies):
                entry["stats"] = ({"error": str(reply)} if isinstance(reply, BaseException) else
                                  {"load": _load_dict(reply.load), "counters": dict(reply.counters)})
        return out

    return app


def _load_dict(load) -> dict:
    return {f.name: getattr(load, f.name) for f in load.DESCRIPTOR.fields}


# -- serving a request ------------------------------------------------------------------------
async def _serve(state: RouterState, body, chat: bool):
    arrived = time.monotonic()
    req, shape, out = await _prepare(state, body, chat)
    m = state.metrics
    m.prompt_tokens.inc(len(req.prompt_token_ids))
    deltas = _timed(state, state.orchestrator.generate(req), arrived, "chat" if chat else "completions", req.n)
    try:
        first = await deltas.__anext__()
    except BaseException as exc:
        await deltas.aclose()
        if isinstance(exc, RouterError):
            m.errors.labels(exc.code or exc.type).inc()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(state.tokenizer, m, shape, req, first, deltas, include_usage, out),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await collect(state.tokenizer, shape, req, first, deltas, out)


async def _prepare(state: RouterState, body, chat: bool) -> tuple[GenerationRequest, Shape, Output]:
    cfg = state.config
    _check_model(state, body.model)
    validate_sampling(body)
    tk = state.tokenizer
    body = with_model_defaults(body, tk.generation_defaults)
    plan = None
    if chat:
        plan = (await asyncio.to_thread(plan_tools, body.tools, body.tool_choice) if body.tools is not None
                else plan_tools(None, body.tool_choice))
        messages = render_messages(chat_messages(body), body.messages, plan, tk.template_has_tools)
        _check_fits(state, sum(tk.min_tokens(m["content"]) for m in messages), "messages")
        offered = ([{"type": "function", "function": f} for f in plan.offered]
                   if plan is not None and tk.template_has_tools else None)
        try:
            text = await asyncio.to_thread(tk.apply_chat_template, messages, tools=offered, **chat_template_args(body))
        except InvalidRequestError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        ids = await _encode(tk, text)
    else:
        prompt = prompt_of(body)
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            _check_fits(state, tk.min_tokens(prompt), "prompt")
            ids = await _encode(tk, prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < tk.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids out of range [0, {tk.vocab_size}): {bad[:5]}",
                                     param="prompt")
    max_tokens, param = requested_max_tokens(body)
    max_tokens = check_lengths(len(ids), max_tokens, param, state.context_length, cfg.max_tokens_limit,
                               default_max_tokens(chat, tk.generation_defaults, state.context_length - len(ids)))
    if body.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({body.min_tokens}) must not exceed {param} ({max_tokens})",
                             param="min_tokens")
    stop_token_ids, logit_bias = token_id_fields(body, tk.vocab_size)
    grammar = await asyncio.to_thread(grammar_of, body) if constrained(body) else ""
    if plan is not None and plan.grammar:
        if grammar:
            raise InvalidRequest("a forced tool_choice cannot be combined with another output constraint",
                                 param="tool_choice")
        grammar = plan.grammar
    n, sequences = choice_counts(body)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    req = GenerationRequest(
        request_id=rid, prompt_token_ids=tuple(ids), max_tokens=max_tokens,
        temperature=effective_temperature(body),
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k, min_p=body.min_p or 0.0, seed=body.seed,
        stop=stop_strings(body), ignore_eos=body.ignore_eos, stop_token_ids=stop_token_ids,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, logit_bias=logit_bias,
        min_tokens=body.min_tokens, prompt_logprobs=prompt_logprobs_k(body), grammar=grammar, n=sequences,
        # best_of ranks the sequences by cumulative logprob: it needs the sampled tokens' logprobs
        logprobs=requested_logprobs(body) if sequences == n else (requested_logprobs(body) or 0))
    echo = not chat and body.echo
    out = Output(logprobs=requested_logprobs(body) is not None, n=n,
                 echo_text=(prompt if isinstance(prompt, str) else tk.decode(ids)) if echo else None,
                 echo_logprobs=echo and req.logprobs is not None,
                 prompt_logprobs=body.prompt_logprobs is not None,
                 tool_names=plan.names if plan is not None else None)
    return req, Shape.new(chat, rid, cfg.served_model_name), out


def _check_model(state: RouterState, model: str | None) -> None:
    """Raise `ModelNotFound` unless ``model`` is None or names the served model."""
    cfg = state.config
    if model is not None and model not in (cfg.served_model_name, state.model_root):
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves "
                            f"'{cfg.served_model_name}'", param="model")


def _check_fits(state: RouterState, min_tokens: int, param: str) -> None:
    """Refuse, before tokenizing, a text whose lower bound of tokens already fills the context."""
    if min_tokens >= state.context_length:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {state.context_length} tokens; the {param} "
            f"has at least {min_tokens} tokens", param=param)


async def _encode(tk, text: str) -> list[int]:
    try:
        if len(text) > _OFFLOAD_CHARS:
            return await asyncio.to_thread(tk.encode, text)
        return tk.encode(text)
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param="prompt") from exc


async def _timed(state: RouterState, deltas: AsyncIterator[Delta], arrived: float,
                 endpoint: str, n_choices: int = 1) -> AsyncIterator[Delta]:
    """Pass deltas through, observing TTFT, ITL and E2E latency; the request counts as in flight
    (`RouterMetrics.in_flight`, counted here only) from the first ``__anext__`` until closed."""
    m = state.metrics
    last = None
    finished: dict[int, str] = {}   # choice -> finish reason
    m.in_flight.inc()
    try:
        async with aclosing(deltas) as it:
            async for d in it:
                now = time.monotonic()
                n = len(d.token_ids)
                if last is None:
                    m.ttft.observe(now - arrived)
                    n -= 1
                    last = now
                if n > 0:
                    for _ in range(n):
                        m.itl.observe((now - last) / n)
                    last = now
                if d.finish_reason is not None:
                    finished[d.index] = d.finish_reason
                    m.generation_tokens.inc(d.completion_tokens)
                    if len(finished) == n_choices:
                        m.e2e.observe(now - arrived)
                        m.requests.labels(endpoint, d.finish_reason).inc()
                yield d
    finally:
        m.in_flight.dec()
    if len(finished) < n_choices:
        m.requests.labels(endpoint, "abort").inc()


# -- errors -------------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError):
        return JSONResponse(router_error_body(exc), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(_validation_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc}", "server_error", None,
                                       "internal_error"), status_code=500)


class RefuseWhenFull:
    """ASGI middleware: while the admission queue is full, a generation request is answered 503
    (`Overloaded`, with ``Retry-After``) before its body is read or validated, so a burst is shed
    at the cost of a header parse per refused request."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, state: "RouterState") -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.PATHS:
            refused = self.state.orchestrator.admission.refuse_now()
            if refused is not None:
                self.state.metrics.errors.labels(refused.code).inc()
                response = JSONResponse(router_error_body(refused), status_code=refused.status,
                                        headers=refused.headers())
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (declared or streamed) gets 413 with an
    OpenAI error body before the app sees it; smaller bodies are read once and replayed."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._reject(scope, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # then disconnects, for streamed responses

        await self.app(scope, replay, send)

    async def _reject(self, scope, send) -> None:
        exc = RequestTooLarge(f"the request body exceeds {self.max_bytes} bytes")
        await JSONResponse(router_error_body(exc), status_code=exc.status)(scope, _no_receive, send)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


def _validation_body(errors) -> dict:
    if not errors:
        return error_body("invalid request", "invalid_request_error")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return error_body(f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}",
                          "invalid_request_error", None, "invalid_json")
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if not loc and e.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return error_body("the request body must be a JSON object", "invalid_request_error")
    return error_body(f"{param or 'body'}: {e.get('msg')}", "invalid_request_error", param, None)
