"""Logprobs, sampling controls, seeded sampling and the tokenizer routes end to end, across the
prefill/decode split (1 prefill + 1 decode over shm: the first token is sampled on the prefill
worker, the rest on the decode worker) and colocated (one decode worker does both), through the
official openai client.

Values are checked against references: logprobs against Hugging Face transformers' float32
log_softmax on the same GGUF weights (within 1e-4), penalties / bias / seeded draws against the
single-process engine with the same parameters (identical tokens)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.e2e.conftest import assert_pools_full, openai_client, worker_stats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
TOL = 1e-4
QUESTION = [{"role": "user", "content": "Name three colors."}]

# Shared clusters (tests/e2e/conftest.py SHARED), under this module's test ids.
TOPOLOGIES = [pytest.param("1p1d-auto", id="disaggregated-1p1d"), pytest.param("0p1d-colocated", id="colocated-0p1d")]


@pytest.fixture(scope="module", params=TOPOLOGIES)
def cluster(request, shared_clusters):
    return shared_clusters.get(request.param)


@pytest.fixture(scope="module")
def hf_logprobs(hf_model):
    """``hf_logprobs(ids) -> [len(ids), vocab]`` float32 log_softmax of transformers' logits."""
    cache: dict = {}

    def run(ids):
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                cache[key] = torch.log_softmax(hf_model(torch.tensor([list(ids)])).logits[0].float(), -1)
        return cache[key]

    return run


def _tokenize(cluster, **body) -> list[int]:
    r = httpx.post(f"{cluster.url}/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _check_against_hf(prompt: list[int], output: list[int], entries, hf, k: int) -> None:
    """``entries``: (token id, logprob, [(top id, top logprob)]) per output token."""
    ref = hf(prompt + output)
    assert len(entries) == len(output)
    for i, (token, logprob, top) in enumerate(entries):
        row = ref[len(prompt) + i - 1]
        assert token == output[i]
        assert abs(logprob - row[token].item()) < TOL, (i, logprob, row[token].item())
        want = row.topk(k)
        assert len(top) == k
        assert abs(top[0][1] - want.values[0].item()) < TOL
        for (tid, value), wid, wvalue in zip(top, want.indices.tolist(), want.values.tolist()):
            assert abs(value - wvalue) < TOL and (tid == wid or abs(value - row[wid].item()) < TOL)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_transformers(cluster, tokenizer, engine_run, hf_logprobs, stream):
    from engine.sampling import SamplingParams

    prompt = _tokenize(cluster, messages=QUESTION)
    want = engine_run(prompt, SamplingParams(max_tokens=10, temperature=0))
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=5)
    client = openai_client(cluster)
    if stream:
        content, text = [], ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    else:
        r = client.chat.completions.create(**kw)
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert text == want.text
    id_of = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    entries = []
    for c in content:
        token = id_of[bytes(c.bytes)]
        assert c.token == tokenizer.token_text(token)
        entries.append((token, c.logprob, [(id_of[bytes(t.bytes)], t.logprob) for t in c.top_logprobs]))
    _check_against_hf(prompt, list(want.token_ids), entries, hf_logprobs, 5)
    assert_pools_full(cluster)


def test_completion_logprobs_legacy_shape(cluster, tokenizer, engine_run, hf_logprobs):
    from engine.sampling import SamplingParams

    prompt_text = "The capital of France is"
    prompt = tokenizer.encode(prompt_text)
    want = engine_run(prompt, SamplingParams(max_tokens=8, temperature=0))
    r = openai_client(cluster).completions.create(model=MODEL, prompt=prompt_text, max_tokens=8,
                                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    assert lp.tokens == [tokenizer.token_text(t) for t in want.token_ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ref = hf_logprobs(prompt + list(want.token_ids))
    for i, token in enumerate(want.token_ids):
        row = ref[len(prompt) + i - 1]
        assert abs(lp.token_logprobs[i] - row[token].item()) < TOL
        top_text = {tokenizer.token_text(t): v for t, v in zip(row.topk(3).indices.tolist(),
                                                                row.topk(3).values.tolist())}
        assert set(top_text) <= set(lp.top_logprobs[i]) and len(lp.top_logprobs[i]) <= 4
        for text, value in top_text.items():
            assert abs(lp.top_logprobs[i][text] - value) < TOL


@pytest.mark.parametrize("stream", [False, True])
def test_echo_and_prompt_logprobs_match_transformers(cluster, tokenizer, engine_run, hf_logprobs, stream):
    """What lm-evaluation-harness's loglikelihood requests send (a prompt of token ids, echo,
    logprobs 1, max_tokens 1), plus vLLM's prompt_logprobs field: the prompt tokens' logprobs
    come from the prefill (on the prefill worker when disaggregated)."""
    from engine.sampling import SamplingParams

    text = "The quick brown fox jumps over the lazy dog. The capital of France is"
    prompt = tokenizer.encode(text)
    want = engine_run(prompt, SamplingParams(max_tokens=2, temperature=0))
    body = {"model": MODEL, "prompt": [prompt], "max_tokens": 2, "temperature": 0, "echo": True,
            "logprobs": 1, "prompt_logprobs": 2, "stream": stream}
    with httpx.Client(timeout=120) as http:
        if stream:
            choices = []
            with http.stream("POST", f"{cluster.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choices += json.loads(line[6:])["choices"]
            got_text = "".join(c["text"] for c in choices)
            lp = {k: sum((c["logprobs"][k] for c in choices if c["logprobs"]), []) for k in
                  ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            prompt_lps = next(c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c)
        else:
            r = http.post(f"{cluster.url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            got_text, lp, prompt_lps = choice["text"], choice["logprobs"], choice["prompt_logprobs"]
    assert got_text == text + want.text
    every = prompt + list(want.token_ids)
    assert lp["tokens"] == [tokenizer.token_text(t) for t in every]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(every))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and prompt_lps[0] is None
    ref = hf_logprobs(every)
    for i in range(1, len(every)):
        row = ref[i - 1]
        assert abs(lp["token_logprobs"][i] - row[every[i]].item()) < TOL, i
        best = int(row.argmax())
        assert abs(lp["top_logprobs"][i][tokenizer.token_text(best)] - row[best].item()) < TOL
        if i < len(prompt):
            entry = prompt_lps[i][str(every[i])]
            assert abs(entry["logprob"] - row[every[i]].item()) < TOL
            assert entry["rank"] == int((row > row[every[i]]).sum()) + 1
            assert str(best) in prompt_lps[i] and prompt_lps[i][str(best)]["rank"] == 1
    assert len(prompt_lps) == len(prompt)
    assert_pools_full(cluster)


def test_seeded_sampling_equals_the_single_process_engine(cluster, tokenizer, engine_run):
    """The first token is drawn on the prefill worker, the rest on the decode worker (or all on
    one colocated worker): the same seed gives the single-process engine's tokens."""
    from engine.sampling import SamplingParams

    prompt_text = "Tell me a story about a dragon:"
    prompt = tokenizer.encode(prompt_text)
    client = openai_client(cluster)
    texts = set()
    for seed in (1234, 99):
        want = engine_run(prompt, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=seed))
        r = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=24, temperature=0.9,
                                      top_p=0.95, seed=seed, extra_body={"top_k": 50})
        assert r.choices[0].text == want.text, seed
        texts.add(want.text)
    assert len(texts) == 2


def test_min_p_equals_the_engine(cluster, tokenizer, engine_run):
    """min_p on the wire: a seeded, hot request with min_p gives the single-process engine's
    tokens with min_p (first token on the prefill worker, the rest on the decode worker), which
    differ from the same draws without it."""
    from engine.sampling import SamplingParams

    prompt_text = "Tell me a story about a dragon:"
    prompt = tokenizer.encode(prompt_text)
    plain = engine_run(prompt, SamplingParams(max_tokens=24, temperature=1.8, seed=7))
    want = engine_run(prompt, SamplingParams(max_tokens=24, temperature=1.8, seed=7, min_p=0.1))
    assert want.token_ids != plain.token_ids   # min_p changes this output
    r = openai_client(cluster).completions.create(model=MODEL, prompt=prompt_text, max_tokens=24, temperature=1.8,
                                                  seed=7, extra_body={"min_p": 0.1})
    assert r.choices[0].text == want.text


@pytest.mark.parametrize("controls", [
    {"repetition_penalty": 1.4},
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"presence_penalty": 2.0},
])
def test_penalties_equal_the_engine(cluster, tokenizer, engine_run, controls):
    from engine.sampling import SamplingParams

    prompt_text = "List the numbers: one, two, one, two, one,"
    prompt = tokenizer.encode(prompt_text)
    plain = engine_run(prompt, SamplingParams(max_tokens=20, temperature=0))
    want = engine_run(prompt, SamplingParams(max_tokens=20, temperature=0, **controls))
    assert want.token_ids != plain.token_ids   # the control changes this output
    client = openai_client(cluster)
    r = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=20, temperature=0, extra_body=controls)
    assert r.choices[0].text == want.text
    chunks = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=20, temperature=0, stream=True,
                                       extra_body=controls)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text


def test_logit_bias_min_tokens_and_stop_token_ids(cluster, tokenizer, reference):
    client = openai_client(cluster)
    forced = tokenizer.encode(" banana")[0]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tokenizer.decode([forced] * 5)
    # Greedy chat stops early at the end-of-turn token; min_tokens forbids it until 40 tokens.
    short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=100, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    long = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=100, temperature=0, extra_body={"min_tokens": 40})
    assert long.usage.completion_tokens >= 40
    # A stop token id ends the output there; the text before it is what greedy gives.
    prompt = tokenizer.encode("The capital of France is")
    want = reference(prompt, 12)
    stop_id = want.token_ids[4]
    first = want.token_ids.index(stop_id)
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                  temperature=0, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == first + 1
    assert r.choices[0].text == tokenizer.decode(want.token_ids[:first])
    streamed = list(client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, stream=True, logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced], "min_tokens": 3}, stream_options={"include_usage": True}))
    # the forced token is also a stop token: min_tokens masks it for 3 tokens, then the bias makes it
    # the 4th, which ends the output
    assert "banana" not in "".join(c.choices[0].text for c in streamed if c.choices)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
    assert streamed[-1].usage.completion_tokens == 4
    assert_pools_full(cluster)


def _kv_bytes_sent(cluster) -> float:
    return sum(s.counters.get("kv_bytes_sent", 0.0) for role, s in worker_stats(cluster).values() if role == "prefill")


def test_n_choices_share_one_prefill_and_equal_separate_seeded_requests(cluster, tokenizer, engine_run):
    """n = 3: one prefill (the prompt's KV crosses once), the decode worker forks; choice i is
    what the engine gives a lone request with choice i's seed stream (what a retried choice
    resumes with); streamed chunks carry the index; usage counts every choice."""
    from engine.sampling import SamplingParams, child_params

    prompt_text = "Write one sentence about the ocean:"
    prompt = tokenizer.encode(prompt_text)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3)
    want = [engine_run(prompt, child_params(params, i)) for i in range(3)]
    assert len({w.text for w in want}) == 3
    client = openai_client(cluster)
    before = _kv_bytes_sent(cluster)
    r = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=16, temperature=1.0, seed=7, n=3)
    one_request = _kv_bytes_sent(cluster) - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    if cluster.config.num_prefill:   # disaggregated: the KV of an n = 1 request, once
        before = _kv_bytes_sent(cluster)
        client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=16, temperature=1.0, seed=7)
        assert one_request == _kv_bytes_sent(cluster) - before > 0
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=16, temperature=1.0,
                                           seed=7, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [w.text for w in want]
    # best_of: the n of best_of with the highest cumulative logprob
    scored = [engine_run(prompt, child_params(SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3,
                                                             logprobs=0), i)) for i in range(3)]
    assert [s.text for s in scored] == [w.text for w in want]
    best = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=16, temperature=1.0, seed=7,
                                     n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].text in {w.text for w in want}
    assert best.usage.completion_tokens == r.usage.completion_tokens
    assert_pools_full(cluster)


def test_tokenize_detokenize_and_models(cluster, tokenizer):
    ids = _tokenize(cluster, prompt="Hello, world")
    assert ids == tokenizer.encode("Hello, world")
    chat = httpx.post(f"{cluster.url}/tokenize", json={"messages": QUESTION, "return_token_strs": True},
                      timeout=30).json()
    rendered = tokenizer.apply_chat_template(QUESTION)
    assert chat["tokens"] == tokenizer.encode(rendered) and chat["count"] == len(chat["tokens"])
    assert "".join(chat["token_strs"]) == rendered
    assert chat["max_model_len"] == openai_client(cluster).models.list().data[0].model_extra["max_model_len"]
    back = httpx.post(f"{cluster.url}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": "Hello, world"}


BAD = [
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": QUESTION, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ("/tokenize", {"prompt": "hi", "messages": QUESTION}, "prompt"),
    ("/v1/chat/completions", {"messages": QUESTION, "min_p": 1.5}, "min_p"),
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
]


def test_bad_controls_get_400_naming_the_field(cluster):
    with httpx.Client(timeout=30) as http:
        for path, body, param in BAD:
            r = http.post(cluster.url + path, json={"model": MODEL, **body})
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())
