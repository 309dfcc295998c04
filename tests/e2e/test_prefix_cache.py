"""Prefix caching on both workers (``--prefix-caching``) with KV-aware routing (``--policy kv``),
end to end: a repeated long system prompt and later turns are computed by the prefill worker only
past its cached prefix and sent to the decode worker only past the blocks it holds (delta
transfer); greedy output equals the single-process engine's (which has no cache) turn by turn;
the router indexes both workers' caches; every block is free again (cached blocks count as
free)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import assert_pools_full, openai_client, start_cluster, stop_cluster, worker_stats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a meticulous assistant who answers in plain words. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("prefix"), num_prefill=1, num_decode=1, transfer_engine="auto",
                      worker_args=("--prefix-caching",), router_args=("--policy", "kv"))
    yield c
    stop_cluster(c)


def _prefill_counter(cluster, name: str, role: str = "prefill") -> float:
    return sum(s.counters.get(name, 0.0) for r, s in worker_stats(cluster).values() if r == role)


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


def test_later_turns_send_only_what_the_decode_worker_lacks(cluster, tokenizer, reference):
    """Four turns of one conversation: each turn's text equals the engine's, and from turn 2 on
    the decode worker holds the earlier turns (its own decoded answers included), so the KV
    sent is a small fraction of the prompt's."""
    client = openai_client(cluster)
    per_block = None
    messages = [{"role": "user", "content": "Name three rivers of Europe and say where they flow."}]
    for turn, follow_up in enumerate(["Which one is the longest?", "How long is it, in kilometres?",
                                      "Thank you. Summarize our talk in one sentence.", None]):
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        sent, skipped, held = (_prefill_counter(cluster, "kv_bytes_sent"), _prefill_counter(cluster, "kv_bytes_skipped"),
                               _prefill_counter(cluster, "blocks_held_at_reserve", "decode"))
        steps, rows = (_prefill_counter(cluster, "decode_steps", "decode"),
                       _prefill_counter(cluster, "decode_step_rows", "decode"))
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
        text = reply.choices[0].message.content
        assert text == reference(ids, 32).text, f"turn {turn + 1}"
        # the decode worker's step counters: one decode step per token after the first
        steps = _prefill_counter(cluster, "decode_steps", "decode") - steps
        assert steps == reply.usage.completion_tokens - 1, (steps, reply.usage.completion_tokens)
        assert _prefill_counter(cluster, "decode_step_rows", "decode") - rows == steps
        sent = _prefill_counter(cluster, "kv_bytes_sent") - sent
        skipped = _prefill_counter(cluster, "kv_bytes_skipped") - skipped
        held = _prefill_counter(cluster, "blocks_held_at_reserve", "decode") - held
        blocks = -(-len(ids) // 16)
        if turn == 0:
            per_block = sent / blocks
        else:   # the earlier prompt and most of the earlier answers are held, not sent
            assert held >= len(prev) // 16 and skipped == held * per_block
            assert sent == (blocks - held) * per_block and sent <= 0.4 * blocks * per_block, (turn, sent, blocks)
        prev = ids
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'pdserve_prefix_cache_hits_total{role="decode"}' in metrics
    assert "pdserve_worker_prefix_cache_blocks{" in metrics   # the router indexes the workers' caches
    assert_pools_full(cluster)


def _wait_counter(cluster, name: str, above: float, timeout_s: float = 60.0) -> float:
    end = time.monotonic() + timeout_s
    while (value := _prefill_counter(cluster, name)) <= above:
        assert time.monotonic() < end, f"{name} stayed at {value}"
        time.sleep(0.2)
    return value


def test_the_prefill_worker_warms_up_with_each_answer(cluster, tokenizer, reference):
    """After each turn the router asks the prefill worker to warm its cache with prompt + answer
    (router.warmup): the next turn's prefill computes only past the previous answer."""
    client = openai_client(cluster)
    messages = [{"role": "user", "content": "Tell me about the moons of Jupiter, briefly."}]
    warmed = _prefill_counter(cluster, "warmups_completed")
    history: list[int] = []
    for turn, follow_up in enumerate(["Which is the largest?", "Does it have water?", None]):
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        hits = _prefill_counter(cluster, "prefix_hit_tokens")
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
        expected = reference(ids, 32)
        assert reply.choices[0].message.content == expected.text, f"turn {turn + 1}"
        hit = _prefill_counter(cluster, "prefix_hit_tokens") - hits
        if history:   # the previous prompt and answer, as far as they are this prompt's prefix
            common = next((i for i, (a, b) in enumerate(zip(history, ids)) if a != b), min(len(history), len(ids)))
            assert common // 16 > (len(history) - len(prev_out)) // 16   # the answer is in it
            assert hit == min(common, len(ids) - 1) // 16 * 16, (turn, hit, common)
        warmed = _wait_counter(cluster, "warmups_completed", warmed)
        history, prev_out = ids + list(expected.token_ids)[:-1], list(expected.token_ids)[:-1]
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'pdserve_prefill_warmups_total{outcome="completed"}' in metrics
    assert_pools_full(cluster)
