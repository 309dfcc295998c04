"""Prefix caching on the prefill worker (``--prefix-caching``), end to end: a repeated long
system prompt and a second turn are computed only past their cached prefix, greedy output
equals the single-process engine's, the KV still reaches the decode worker whole, and every
block is free again (cached blocks count as free)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_pools_full, openai_client, start_cluster, stop_cluster, worker_stats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a meticulous assistant who answers in plain words. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("prefix"), num_prefill=1, num_decode=1, transfer_engine="auto",
                      worker_args=("--prefix-caching",))
    yield c
    stop_cluster(c)


def _prefill_counter(cluster, name: str) -> float:
    return sum(s.counters.get(name, 0.0) for role, s in worker_stats(cluster).values() if role == "prefill")


def test_repeated_prefix_is_not_recomputed_and_output_is_unchanged(cluster, tokenizer, reference):
    client = openai_client(cluster)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}]
    ids1 = tokenizer.encode(tokenizer.apply_chat_template(turn1))
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=20, temperature=0)
    assert first.choices[0].message.content == reference(ids1, 20).text
    hits_before = _prefill_counter(cluster, "prefix_hit_tokens")
    again = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=20, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    hit = _prefill_counter(cluster, "prefix_hit_tokens") - hits_before
    assert hit == (len(ids1) - 1) // 16 * 16 >= 128
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Answer in one word."}]
    ids2 = tokenizer.encode(tokenizer.apply_chat_template(turn2))
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, temperature=0)
    assert second.choices[0].message.content == reference(ids2, 12).text
    assert _prefill_counter(cluster, "prefix_hit_tokens") - hits_before > hit   # turn 2 hit the system prompt
    assert_pools_full(cluster)
