"""Abort storm: over a hundred clients disconnecting at random points (before the first token, so
during prefill and KV transfer, and mid-stream), one in ten never cut. Every stream that finished
must equal the single-process engine's greedy answer, every pool must be full again afterwards,
and later requests' greedy output must still equal the engine's."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.e2e.conftest import assert_pools_full, start_cluster, stop_cluster, worker_stats

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
NUM_CLIENTS = 128
MAX_TOKENS = 64


@pytest.fixture(scope="module", params=["tcp", "tcp-prefix-caching"])
def storm_cluster(request, tmp_path_factory):
    """1P1D over tcp; the second run with prefix caching and KV-aware routing: the storm's
    prompts repeat, so aborted transfers land next to held, shared prefix blocks."""
    cached = request.param.endswith("prefix-caching")
    c = start_cluster(tmp_path_factory.mktemp("storm"), num_prefill=1, num_decode=1, transfer_engine="tcp",
                      worker_args=("--prefix-caching",) if cached else (),
                      router_args=("--policy", "kv") if cached else ())
    yield c
    stop_cluster(c)


async def _client(http: httpx.AsyncClient, url: str, prompt: str, give_up_after: float,
                  give_up_at_chunk: int, outcome: dict) -> None:
    """Disconnect after ``give_up_after`` seconds or at chunk ``give_up_at_chunk``; records the
    HTTP status, the streamed text, errors and whether the stream finished."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    outcome.update(prompt=prompt, text="", errors=[])

    async def run():
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            outcome["status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome["errors"].append(event["error"])
                        continue
                    outcome["text"] += event["choices"][0]["text"]
                    outcome["chunks"] = outcome.get("chunks", 0) + 1
                    if outcome["chunks"] >= give_up_at_chunk:
                        return False  # leaving the block closes the connection mid-stream
                elif line == "data: [DONE]":
                    outcome["done"] = True
        return True
    try:
        outcome["finished"] = await asyncio.wait_for(run(), give_up_after)
    except (asyncio.TimeoutError, httpx.HTTPError):
        outcome["finished"] = False


async def _storm(url: str, prompts: list[str], seed: int) -> list[dict]:
    rng = random.Random(seed)
    outcomes = [{} for _ in range(NUM_CLIENTS)]
    limits = httpx.Limits(max_connections=64)
    gate = asyncio.Semaphore(24)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        async def one(i, prompt, seconds, chunk):
            async with gate:
                await _client(http, url, prompt, seconds, chunk, outcomes[i])
        tasks = []
        for i in range(NUM_CLIENTS):
            await asyncio.sleep(rng.expovariate(20.0))
            if i % 10 == 0:   # never cut: some streams must finish under the storm, exact
                seconds, chunk = 120.0, 10**9
            elif i % 10 == 5:   # cut 20 ms after sending: before any first token, however fast
                seconds, chunk = 0.02, 10**9
            elif i % 2:  # cut at a random time: queued, prefilling, transferring or streaming
                seconds, chunk = rng.uniform(0.05, 2.0), 10**9
            else:      # cut after a few streamed chunks
                seconds, chunk = 60.0, rng.randint(1, 8)
            tasks.append(asyncio.create_task(one(i, rng.choice(prompts), seconds, chunk)))
        await asyncio.gather(*tasks)
    return outcomes


def test_abort_storm_leaves_pools_full_and_outputs_correct(storm_cluster, tokenizer, reference):
    # prompts of 6 to ~130 tokens: several blocks to transfer, and a prefill a cut can land in
    prompts = ["Tell me about the ocean.", "word " * 120, "Explain photosynthesis step by step. " * 8,
               "List ten animals.", "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 12]
    outcomes = asyncio.run(_storm(storm_cluster.url, prompts, seed=7))
    cut_early = sum(1 for o in outcomes if not o["finished"] and not o.get("chunks"))
    cut_mid = sum(1 for o in outcomes if not o["finished"] and o.get("chunks"))
    print(f"\nabort storm: {NUM_CLIENTS} clients, {cut_early} gone before the first token, "
          f"{cut_mid} mid-stream, {NUM_CLIENTS - cut_early - cut_mid} finished")
    assert cut_early >= 10 and cut_mid >= 10, "the storm must cut requests both before and during streaming"
    # every answer that arrived was a 200 with no error event; every finished stream is exact
    statuses = {o.get("status") for o in outcomes} - {None}
    assert statuses == {200}, statuses
    assert not [o["errors"] for o in outcomes if o["errors"]]
    finished = [o for o in outcomes if o["finished"]]
    assert len(finished) >= NUM_CLIENTS // 10 and all(o.get("done") for o in finished)
    for o in finished:
        want = reference(tokenizer.encode(o["prompt"]), MAX_TOKENS).text
        assert o["text"] == want, o["prompt"][:40]
    for o in outcomes:   # what a cut stream received is a prefix of the exact answer
        if o["text"]:
            assert reference(tokenizer.encode(o["prompt"]), MAX_TOKENS).text.startswith(o["text"])
    stats = worker_stats(storm_cluster)
    print("decode counters:", {k: v for _, (role, s) in stats.items() if role == "decode"
                               for k, v in s.counters.items() if v})
    assert_pools_full(storm_cluster, timeout_s=60)
    # later requests are still exact
    for text in ("What is the capital of France?", "Write a haiku about autumn."):
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        r = httpx.post(f"{storm_cluster.url}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": ids, "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(ids, 32).text
    assert_pools_full(storm_cluster, timeout_s=10)
