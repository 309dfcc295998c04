"""The HTTP API without workers: request validation, OpenAI error bodies, models/health/metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.api import build_state, create_app
from router.config import RouterConfig
from router.membership import Membership

pytestmark = pytest.mark.unit

CONTEXT = 64
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizer import Tokenizer
    from engine.modelfile import resolve_model_path

    return Tokenizer.from_file(resolve_model_path(None))


@pytest.fixture
def client(tokenizer):
    state = build_state(RouterConfig(wait_for_workers_s=0.0), tokenizer, CONTEXT, Membership(), "/models/smollm.gguf")
    with TestClient(create_app(state)) as c:
        yield c


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (m,) = body["data"]
    assert m["id"] == MODEL and m["object"] == "model" and m["owned_by"] and m["root"] == "/models/smollm.gguf"


def test_health_without_workers_is_503(client):
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["prefill"] == 0 and r.json()["decode"] == 0


def test_metrics_exposes_the_histograms(client):
    text = client.get("/metrics").text
    for name in ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                 "pdserve_e2e_request_latency_seconds", "pdserve_kv_transfer_bytes",
                 "pdserve_queue_depth", "pdserve_requests_in_flight"):
        assert name in text


def test_admin_workers_empty(client):
    assert client.get("/admin/workers").json() == []


def test_malformed_json_is_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")
    r = client.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [999999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 2.5}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "strin"}}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2147483648}, "top_k"),   # was a 500 (int32)
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 1025}, "stop"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": -0.1}, "min_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"enable_thinking": False, "messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message"),   # add_generation_prompt defaults to true
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": None}},
     "chat_template_kwargs"),
])
def test_bad_requests_are_400(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param=param)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": "caf\\ud800e"}', "prompt"),                  # was a 500
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     "messages.0.content"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "hi", "min_p": NaN}', "min_p"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "\\ud800"}}',
     "chat_template_kwargs"),
])
def test_invalid_unicode_and_non_finite_numbers_are_400(client, path, raw, param):
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert_error(r, 400, param=param)


def test_tiny_temperature_means_greedy():
    from router.protocol import CompletionRequest, effective_temperature

    assert effective_temperature(CompletionRequest(prompt="x", temperature=1e-40)) == 0.0
    assert effective_temperature(CompletionRequest(prompt="x", temperature=0.7)) == 0.7
    assert effective_temperature(CompletionRequest(prompt="x")) == 1.0


def test_body_over_the_cap_is_413(tokenizer):
    state = build_state(RouterConfig(wait_for_workers_s=0.0, max_request_bytes=1000), tokenizer, CONTEXT,
                        Membership(), "/models/smollm.gguf")
    with TestClient(create_app(state)) as c:
        assert_error(c.post("/v1/completions", json={"prompt": "x" * 2000}), 413, code="request_too_large")

        def chunks():   # no Content-Length: counted while streaming in
            for _ in range(10):
                yield b" " * 200
        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        assert_error(c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}), 503, code="no_workers")


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tokenizer, monkeypatch):
    calls = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(len(text)) or real(text))
    state = build_state(RouterConfig(wait_for_workers_s=0.0), tokenizer, CONTEXT, Membership(), "/m.gguf")
    with TestClient(create_app(state)) as c:
        huge = "x" * (CONTEXT * tokenizer.max_token_bytes)
        err = assert_error(c.post("/v1/completions", json={"prompt": huge}), 400, code="context_length_exceeded")
        assert "at least" in err["message"]
        chat = {"messages": [{"role": "user", "content": huge}]}
        assert_error(c.post("/v1/chat/completions", json=chat), 400, code="context_length_exceeded")
    assert calls == []


def test_prompt_over_context_is_400(client):
    long_prompt = "word " * (CONTEXT + 10)
    assert_error(client.post("/v1/completions", json={"prompt": long_prompt}), 400,
                 code="context_length_exceeded")
    assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": CONTEXT}), 400,
                 param="max_tokens", code="context_length_exceeded")


def test_wrong_model_is_404(client):
    assert_error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404,
                 param="model", code="model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_valid_request_without_workers_is_503(client, stream):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream,
            "some_future_field": {"x": 1}, "temperature": 0, "stop": "\n"}
    assert_error(client.post("/v1/completions", json=body), 503, code="no_workers")
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": stream, "stream_options": {"include_usage": True}, "max_completion_tokens": 3}
    assert_error(client.post("/v1/chat/completions", json=chat), 503, code="no_workers")


def test_unknown_route_is_an_openai_404(client):
    assert_error(client.get("/v1/nothing"), 404)


def test_schemas_get_strict_objects_unless_they_say_otherwise():
    from router.structured import strict_objects

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}},
                                               "e": {"type": "object"}},
              "$defs": {"x": {"properties": {}, "additionalProperties": True}}}
    got = strict_objects(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["e"]      # a free-form object stays free
    assert got["$defs"]["x"]["additionalProperties"] is True        # said explicitly: kept
    assert "additionalProperties" not in schema                       # the input is not changed
