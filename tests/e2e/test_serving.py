"""The OpenAI API end to end on real clusters (1 prefill + 1 decode over shm, 2 + 2 over tcp),
with the official openai client: greedy output equals the single-process engine's, usage is
right, concurrency, stop strings, bad requests, client disconnects, and every KV block returns."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import assert_pools_full, openai_client, stream_then_disconnect, worker_stats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
MAX_TOKENS = 16


def test_health_models_and_membership(cluster):
    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["prefill"] == cluster.config.num_prefill
    assert health.json()["decode"] == cluster.config.num_decode
    models = openai_client(cluster).models.list()
    assert [m.id for m in models.data] == [MODEL]
    workers = httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()
    assert {w["state"] for w in workers} == {"CONNECTED"}
    assert {w["transfer_engine"] for w in workers} == {cluster.config.transfer_engine}


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_matches_engine(cluster, reference, tokenizer, stream):
    client = openai_client(cluster)
    for prompt in PROMPTS[:2]:
        want = reference(tokenizer.encode(prompt), MAX_TOKENS)
        if stream:
            chunks = list(client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
            assert chunks[-1].choices == []
        else:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == want.text
        assert finish == want.finish_reason.value
        assert usage.prompt_tokens == len(want.prompt_token_ids)
        assert usage.completion_tokens == len(want.token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert_pools_full(cluster)


def test_completion_with_token_id_prompt(cluster, reference, tokenizer):
    ids = tokenizer.encode(PROMPTS[3])
    r = openai_client(cluster).completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == reference(ids, 8).text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_matches_engine(cluster, reference, tokenizer, stream):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    want = reference(ids, 24)
    client = openai_client(cluster)
    if stream:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.role == "assistant"
        text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    assert text == want.text
    assert finish == want.finish_reason.value
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want.token_ids))


def test_stop_string_cuts_text_and_frees_blocks(cluster, reference, tokenizer):
    prompt = "1, 2, 3, 4, 5,"
    full = reference(tokenizer.encode(prompt), 24).text
    stop = full.strip()[3:5] if len(full.strip()) > 5 else ","
    want = reference(tokenizer.encode(prompt), 24, stop=(stop,))
    r = openai_client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                  temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert_pools_full(cluster)


def test_sixteen_concurrent_requests(cluster, reference, tokenizer):
    client = openai_client(cluster)

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True)
            return prompt, "".join(c.choices[0].text for c in chunks if c.choices)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return prompt, r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert len(results) == 16
    for prompt, text in results:
        assert text == reference(tokenizer.encode(prompt), MAX_TOKENS).text, prompt
    assert_pools_full(cluster)


def test_sampling_with_seed_is_reproducible(cluster):
    client = openai_client(cluster)
    kw = dict(model=MODEL, prompt="Tell me a story:", max_tokens=12, temperature=0.8, top_p=0.9,
              seed=1234, extra_body={"top_k": 40})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "x", "prompt": ', 400),
    ("/v1/completions", {"model": MODEL, "max_tokens": 5}, 400),
    ("/v1/chat/completions", {"model": MODEL}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"model": "gpt-5", "prompt": "hi"}, 404),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 7}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": -1}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 30}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": 2147483648}, 400),        # was a 500
    ("/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": "\\ud800"}', 400),  # was a 500
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400),
]


def test_bad_requests_get_4xx_and_do_not_disturb_a_good_one(cluster, reference, tokenizer):
    client = openai_client(cluster)
    result = {}

    def good():
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=32,
                                           temperature=0, stream=True)
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    t = threading.Thread(target=good, name="good-request")
    t.start()
    with httpx.Client(timeout=60) as http:
        for path, body, status in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(cluster.url + path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(cluster.url + path, json=body)
            assert r.status_code == status, (path, body if isinstance(body, bytes) else list(body), r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and "param" in err and "code" in err
    t.join(timeout=300)
    assert result["text"] == reference(tokenizer.encode(PROMPTS[2]), 32).text
    assert_pools_full(cluster)


def test_tiny_temperature_is_greedy_and_fails_nobody(cluster, reference, tokenizer):
    """temperature 1e-40 overflowed to inf in sampling and failed its whole batch (prefill and
    decode) on every retry: a 502 for it and for every request batched with it."""
    client = openai_client(cluster)

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=1e-40 if i % 2 else 0)
        return prompt, r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for prompt, text in results:
        assert text == reference(tokenizer.encode(prompt), MAX_TOKENS).text, prompt
    assert_pools_full(cluster)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(cluster):
    body = {"model": MODEL, "prompt": "Write a long essay about the history of Rome.",
            "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    before = _decode_aborted(cluster)   # the cluster is shared: count this test's aborts only
    got = stream_then_disconnect(cluster, body, chunks=5)
    assert got == 5
    assert_pools_full(cluster, timeout_s=30)
    assert _decode_aborted(cluster) - before >= 1


def _decode_aborted(cluster) -> float:
    return sum(s.counters.get("requests_aborted", 0) for role, s in worker_stats(cluster).values()
               if role == "decode")


def test_metrics_recorded(cluster):
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    count = [line for line in text.splitlines() if line.startswith("pdserve_time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[-1]) > 0
    assert "pdserve_kv_transfer_bytes_total" in text
    assert 'pdserve_worker_free_blocks{role="decode"' in text
