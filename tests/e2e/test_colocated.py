"""Colocated and auto serving modes end to end (`router.serving`): a cluster with no prefill
worker serving every request on decode workers (``Decode.ServeColocated``), and a 1 prefill + 1 decode
cluster in auto mode sending short prompts colocated and long ones disaggregated. Greedy output
equals the single-process engine's on both paths, requests are counted by path, stop strings and
client disconnects free every KV block, and workers are pinned to the CPUs asked for. A third
cluster runs auto mode with tensor-parallel workers beside TP-1 ones (SmolLM2, 3 KV heads: a
prefill and a decode worker over 3 ranks each, `worker.tp_rank`), so KV moves TP 3 -> 1, 1 -> 3,
3 -> 3 and 1 -> 1 and short prompts run colocated on 3 ranks: the same answers, the TP sizes in
/admin/workers and the metrics, and a prefill rank then a decode rank killed with SIGKILL under
load each take their worker out while every request completes on the others."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (assert_pools_full, openai_client, start_cluster, stop_cluster,
                                stream_then_disconnect)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 8  # auto mode: prompts under 8 tokens run colocated
SHORT = "The capital of France is"                                            # 5 tokens
LONG = "Once upon a time, in a small village by the sea, there lived an old"  # > 8 tokens
MAX_TOKENS = 16

MODES = {
    "colocated-0p2d": dict(num_prefill=0, num_decode=2, serving_mode="colocated",
                           cpu_affinity=(0, 1)),
    "auto-1p1d": dict(num_prefill=1, num_decode=1, serving_mode="auto",
                      colocated_threshold_tokens=THRESHOLD, transfer_engine="auto"),
    "auto-tp3": dict(num_prefill=2, num_decode=2, serving_mode="auto", colocated_threshold_tokens=THRESHOLD,
                     prefill_tp=(3, 1), decode_tp=(3, 1)),
}


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request, tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp(request.param), **MODES[request.param])
    c.mode = MODES[request.param]["serving_mode"]
    yield c
    stop_cluster(c)


def path_counts(cluster) -> dict[str, float]:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in
            re.findall(r'^pdserve_requests_by_path_total\{path="(\w+)"\} (\S+)$', text, re.M)}


def expected_path(cluster, tokenizer, prompt: str) -> str:
    if cluster.mode == "colocated" or len(tokenizer.encode(prompt)) < THRESHOLD:
        return "colocated"
    return "disaggregated"


def test_health_and_membership(cluster):
    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert health.status_code == 200, health.text
    assert health.json()["prefill"] == cluster.config.num_prefill
    assert health.json()["decode"] == cluster.config.num_decode
    workers = httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()
    assert {w["state"] for w in workers} == {"CONNECTED"}


def test_prompt_lengths_straddle_the_threshold(tokenizer):
    assert len(tokenizer.encode(SHORT)) < THRESHOLD <= len(tokenizer.encode(LONG))


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_matches_engine_on_each_path(cluster, reference, tokenizer, stream):
    client = openai_client(cluster)
    for prompt in (SHORT, LONG):
        before = path_counts(cluster)
        want = reference(tokenizer.encode(prompt), MAX_TOKENS)
        if stream:
            chunks = list(client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == want.text
        assert finish == want.finish_reason.value
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
        after = path_counts(cluster)
        path = expected_path(cluster, tokenizer, prompt)
        assert after.get(path, 0) == before.get(path, 0) + 1, (prompt, before, after)
    assert_pools_full(cluster)


def test_chat_greedy_matches_engine(cluster, reference, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = reference(tokenizer.encode(tokenizer.apply_chat_template(messages)), 24)
    r = openai_client(cluster).chat.completions.create(model=MODEL, messages=messages,
                                                       max_completion_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text
    assert_pools_full(cluster)


def test_concurrent_mixed_requests(cluster, reference, tokenizer):
    client = openai_client(cluster)

    def one(i):
        prompt = (SHORT, LONG)[i % 2]
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=bool(i % 3))
        if i % 3:
            return prompt, "".join(c.choices[0].text for c in chunks if c.choices)
        return prompt, chunks.choices[0].text

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    for prompt, text in results:
        assert text == reference(tokenizer.encode(prompt), MAX_TOKENS).text, prompt
    assert_pools_full(cluster)


def test_stop_string_cuts_text_and_frees_blocks(cluster, reference, tokenizer):
    prompt = "1, 2, 3, 4, 5,"
    full = reference(tokenizer.encode(prompt), 24).text
    stop = full.strip()[3:5] if len(full.strip()) > 5 else ","
    want = reference(tokenizer.encode(prompt), 24, stop=(stop,))
    r = openai_client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                  temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert_pools_full(cluster)


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_client_disconnect_mid_stream_frees_blocks(cluster, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    got = stream_then_disconnect(cluster, body, chunks=5)
    assert got == 5
    assert_pools_full(cluster, timeout_s=30)


def test_workers_are_pinned_as_asked(cluster):
    for w in cluster.workers:
        allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)$",
                            Path(f"/proc/{w.pid}/status").read_text(), re.M).group(1)
        if cluster.config.cpu_affinity:
            assert allowed == ",".join(map(str, cluster.cpus[w.name])), w.name
    if cluster.config.cpu_affinity:   # each lends its CPU to the other while it waits for work
        assert cluster.cpus == {"decode-0": (0,), "decode-1": (1,)}
        assert cluster.lent == {"decode-0": {1}, "decode-1": {0}}


def _tp_ranks(pid: int) -> list[int]:
    """The tensor-parallel follower processes a worker started (its children named pdserve-tp-r<r>)."""
    ranks = []
    for p in Path("/proc").iterdir():
        try:
            stat = (p / "stat").read_text()
        except (OSError, ValueError):
            continue
        comm, ppid = stat[stat.index("(") + 1:stat.rindex(")")], int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == pid and comm.startswith("pdserve-tp-r"):
            ranks.append(int(p.name))
    return sorted(ranks)


def test_tensor_parallel_sizes_are_shown(cluster):
    workers = {w["id"]: w for w in httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()}
    sizes = {name: w["tensor_parallel_size"] for name, w in workers.items()}
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    shown = {m[0]: int(float(m[1])) for m in re.findall(
        r'^pdserve_worker_tensor_parallel_size\{role="\w+",worker_id="([\w-]+)"\} (\S+)$', metrics, re.M)}
    expect = {}
    for w in cluster.workers:
        tp = cluster.config.decode_tp if w.name.startswith("decode") else cluster.config.prefill_tp
        expect[w.name] = tp[min(int(w.name.split("-")[1]), len(tp) - 1)]
    assert sizes == expect == shown
    for w in cluster.workers:
        assert len(_tp_ranks(w.pid)) == expect.get(w.name, 1) - 1, w.name


def test_killed_tp_ranks_take_their_workers_out_and_every_request_completes(cluster, reference, tokenizer):
    """A prefill rank killed mid-transfer, then a decode rank killed mid-decode, each under load:
    its worker exits (code 4, lost), its ranks are gone, every request completes with the
    reference text (retried on the TP-1 workers), and the pools left are full."""
    if cluster.config.num_prefill < 2 or max(cluster.config.decode_tp) == 1:
        pytest.skip("only the tensor-parallel cluster has ranks to kill")
    client = openai_client(cluster)

    def load(i, stop):   # requests one after another until ``stop``: every worker stays busy
        done = []
        while not stop.is_set():
            prompt = (LONG, SHORT, LONG + " man")[(i + len(done)) % 3]
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True)
            done.append((prompt, "".join(c.choices[0].text for c in chunks if c.choices)))
        return done

    def retries() -> float:
        text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        return float(re.search(r"^pdserve_request_retries_total (\S+)$", text, re.M).group(1))

    left = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    for victim in ("prefill-0", "decode-0"):
        worker = next(w for w in cluster.workers if w.name == victim)
        ranks = _tp_ranks(worker.pid)
        assert len(ranks) == 2
        before, stop = retries(), threading.Event()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(load, i, stop) for i in range(8)]
            time.sleep(2.0)   # prefills writing and decodes stepping on every worker
            os.kill(ranks[0], signal.SIGKILL)
            time.sleep(2.0)
            stop.set()
            results = [r for f in futures for r in f.result()]
        for prompt, text in results:
            assert text == reference(tokenizer.encode(prompt), MAX_TOKENS).text, (victim, prompt)
        if victim.startswith("decode"):   # a decode worker is always mid-request under this load
            assert retries() > before, victim
        deadline = time.monotonic() + 60
        while worker.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not worker.alive() and worker.popen.returncode == 4, victim   # lost (`worker.runtime.serve`)
        assert not any(Path(f"/proc/{r}").exists() and "Z" not in Path(f"/proc/{r}/stat").read_text().split()[2]
                       for r in ranks)
        left.remove(victim)
        workers = httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()
        assert sorted(w["id"] for w in workers) == sorted(left)
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference(tokenizer.encode(LONG), MAX_TOKENS).text
    assert_pools_full(cluster, num_workers=2)
