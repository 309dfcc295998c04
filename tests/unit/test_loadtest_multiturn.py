"""Multi-turn and shared-prefix workloads (loadtest.multiturn) and the prefix bench's verdicts:
conversation and group construction, the report math from constructed inputs."""

import pytest

from bench.prefix import compare_outputs, multiturn_verdicts, shared_prefix_verdict
from loadtest.errors import DatasetError
from loadtest.multiturn import (Conversation, build_conversations, build_shared_prefix,
                                counter_delta, multiturn_rows, percentile_ms, sum_counters,
                                table_lines, truncate_tokens, turn_messages)

pytestmark = pytest.mark.unit


def _record(i, humans, gpt="an answer " * 30):
    turns = []
    for h in humans:
        turns += [{"from": "human", "value": h}, {"from": "gpt", "value": gpt + str(i)}]
    return {"id": f"r{i}", "conversations": turns}


# 10 records with 1..10 human turns each, distinct texts.
RECORDS = [_record(i, [f"question {i}.{t} " + "word " * (5 * t) for t in range(i + 1)])
           for i in range(10)]


@pytest.fixture(scope="module")
def sharegpt():
    from loadtest.sharegpt import load_records

    return load_records()  # the packaged file, ~0.7 s


def test_conversations_have_the_asked_turns_and_are_seeded():
    convs = build_conversations(RECORDS, 4, 5, seed=1, max_user_tokens=1000)
    assert [c.id for c in convs] == ["c0", "c1", "c2", "c3"]
    assert all(len(c.user_messages) == 5 for c in convs)
    by_id = {r["id"]: r for r in RECORDS}
    for c in convs:  # the first 5 human turns of a record with >= 5 of them, in order
        humans = [t["value"] for t in by_id[c.source_id]["conversations"] if t["from"] == "human"]
        assert len(humans) >= 5 and list(c.user_messages) == humans[:5]
    assert convs == build_conversations(RECORDS, 4, 5, seed=1, max_user_tokens=1000)
    other = build_conversations(RECORDS, 4, 5, seed=2, max_user_tokens=1000)
    assert [c.source_id for c in other] != [c.source_id for c in convs]
    with pytest.raises(DatasetError, match="only 6 conversations have 5"):
        build_conversations(RECORDS, 7, 5)


def test_long_messages_are_cut_to_about_max_user_tokens():
    text = "abcdefg " * 100  # 800 characters, ~200 tokens
    assert truncate_tokens(text, 50) == ("abcdefg " * 25).rstrip()  # 200 chars, cut at a space
    assert truncate_tokens("x" * 300, 50) == "x" * 200  # no space: a hard cut
    assert truncate_tokens("short", 50) == "short"
    convs = build_conversations([_record(0, [text, text])], 1, 2, max_user_tokens=50)
    assert all(len(m) == 199 for m in convs[0].user_messages)


def test_turn_t_carries_the_answers_of_earlier_turns():
    conv = Conversation("c0", "r", ("u1", "u2", "u3"))
    assert turn_messages(conv, 1, []) == [{"role": "user", "content": "u1"}]
    msgs = turn_messages(conv, 3, ["a1", "a2"])
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"), ("user", "u3")]
    assert turn_messages(conv, 2, ["a1", "a2"])[-2:] == [{"role": "assistant", "content": "a1"},
                                                         {"role": "user", "content": "u2"}]
    with pytest.raises(ValueError):
        turn_messages(conv, 3, ["a1"])
    with pytest.raises(ValueError):
        turn_messages(conv, 4, ["a1", "a2", "a3"])


def test_real_sharegpt_conversations(sharegpt):
    convs = build_conversations(sharegpt, 8, 4, seed=0, max_user_tokens=256)
    assert len(convs) == 8 and len({c.source_id for c in convs}) == 8
    assert all(len(c.user_messages) == 4 and all(0 < len(m) <= 1024 for m in c.user_messages)
               for c in convs)
    assert convs == build_conversations(sharegpt, 8, 4, seed=0, max_user_tokens=256)


def test_groups_share_exactly_their_system_prompt(sharegpt):
    reqs = build_shared_prefix(sharegpt, 4, 6, system_tokens=400, seed=3, max_user_tokens=64)
    assert len(reqs) == 24 and len({r.id for r in reqs}) == 24
    systems = {g: {r.system for r in reqs if r.group == g} for g in range(4)}
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per group
    texts = [s.pop() for s in systems.values()]
    assert len(set(texts)) == 4 and all(1200 <= len(t) <= 1600 for t in texts)  # ~400 tokens
    assert len({t[:60] for t in texts}) == 4  # they differ within the first block
    assert len({r.question for r in reqs}) == 24 and all(len(r.question) <= 256 for r in reqs)
    assert reqs[0].messages() == [{"role": "system", "content": reqs[0].system},
                                  {"role": "user", "content": reqs[0].question}]
    assert reqs == build_shared_prefix(sharegpt, 4, 6, 400, seed=3, max_user_tokens=64)
    groups = [r.group for r in reqs]
    assert groups != sorted(groups)  # interleaved, not group after group
    other = build_shared_prefix(sharegpt, 4, 6, 400, seed=4, max_user_tokens=64)
    assert [r.id for r in other] != [r.id for r in reqs]


def test_shared_prefix_needs_enough_text():
    with pytest.raises(DatasetError, match="distinct questions"):
        build_shared_prefix(RECORDS, 1, 20, system_tokens=10)
    with pytest.raises(DatasetError, match="answer text"):
        build_shared_prefix(RECORDS[:2], 2, 1, system_tokens=5000)


def _workers(p_prompt, p_hit, sent, skipped, d_hit, d_lookup, split=True):
    """/admin/workers?stats=1 JSON with the counters split over two workers per role."""
    half = 0.5 if split else 1.0
    pre = {"prompt_tokens": p_prompt * half, "prefix_hit_tokens": p_hit * half,
           "kv_bytes_sent": sent * half, "kv_bytes_skipped": skipped * half, "other": 7.0}
    dec = {"prefix_hit_blocks": d_hit * half, "prefix_lookup_blocks": d_lookup * half,
           "cache_evictions": 0.0}
    return [{"id": "prefill-0", "role": "prefill", "stats": {"counters": pre}},
            {"id": "prefill-1", "role": "prefill", "stats": {"counters": pre}},
            {"id": "decode-0", "role": "decode", "stats": {"counters": dec}},
            {"id": "decode-1", "role": "decode", "stats": {"counters": dec}}]


def test_counters_are_summed_per_role_and_missing_ones_count_zero():
    snap = sum_counters(_workers(100, 40, 1000, 300, 4, 10))
    assert snap["prefill"] == {"prompt_tokens": 100, "prefix_hit_tokens": 40, "kv_bytes_sent": 1000,
                               "kv_bytes_skipped": 300, "warmup_tokens_computed": 0}   # missing: 0
    assert snap["decode"] == {"prefix_hit_blocks": 4, "prefix_lookup_blocks": 10, "cache_evictions": 0}
    old = [{"id": "p", "role": "prefill", "stats": {"counters": {"prompt_tokens": 5.0}}},
           {"id": "d", "role": "decode", "stats": {"error": "unavailable"}}]
    snap = sum_counters(old)
    assert snap["prefill"]["kv_bytes_skipped"] == 0 and snap["prefill"]["prompt_tokens"] == 5
    assert snap["errors"] == ["d: unavailable"]


def _rec(conv, turn, ttft, latency=1.0, error=""):
    return {"conversation": conv, "turn": turn, "ttft_s": ttft, "latency_s": latency,
            "prompt_tokens": 100 * turn, "output_tokens": 8, "text": f"{conv}{turn}", "error": error}


def test_percentile_is_numpy_linear_in_ms():
    assert percentile_ms([0.1, 0.2, 0.3, 0.4], 50) == pytest.approx(250.0)
    assert percentile_ms([0.1, 0.2, 0.3, 0.4], 90) == pytest.approx(370.0)
    assert percentile_ms([], 50) is None


def test_rows_per_turn_and_turns_after_the_first():
    snaps = [sum_counters(_workers(*v)) for v in (
        (0, 0, 0, 0, 0, 0), (400, 0, 4000, 0, 0, 20), (1000, 480, 6000, 3000, 8, 30),
        (1800, 1200, 8000, 6000, 20, 50))]
    records = [_rec("c0", 1, 0.4), _rec("c1", 1, 0.6), _rec("c0", 2, 0.1, 0.5),
               _rec("c1", 2, 0.3, 0.7), _rec("c0", 3, 0.2), _rec("c1", 3, 0.0, error="HTTP 503")]
    rows = multiturn_rows(records, snaps)
    assert [r["label"] for r in rows] == ["turn 1", "turn 2", "turn 3", "turns >= 2"]
    t1, t2, t3, later = rows
    assert (t1["requests"], t1["errors"], t1["prefill_hit_rate"], t1["decode_hit_rate"]) == (2, 0, 0.0, 0.0)
    assert t1["ttft_p50_ms"] == pytest.approx(500) and t1["kv_bytes_sent_per_request"] == 2000
    assert t2["prefill_hit_rate"] == pytest.approx(480 / 600) and t2["decode_hit_rate"] == pytest.approx(0.8)
    assert t2["kv_bytes_sent_per_request"] == 1000 and t2["kv_bytes_skipped_per_request"] == 1500
    assert t2["ttft_p90_ms"] == pytest.approx(280) and t2["latency_p50_ms"] == pytest.approx(600)
    assert (t3["requests"], t3["errors"], t3["ttft_p50_ms"]) == (2, 1, pytest.approx(200))
    assert t3["prompt_tokens_mean"] == 300  # failed requests are left out of times and tokens
    assert later["requests"] == 4 and later["errors"] == 1
    assert later["prefill_hit_rate"] == pytest.approx(1200 / 1400)
    assert later["decode_hit_rate"] == pytest.approx(20 / 30)
    assert later["kv_bytes_sent_per_request"] == 1000 and later["kv_bytes_skipped_per_request"] == 1500
    assert later["ttft_p50_ms"] == pytest.approx(200)
    lines = table_lines(rows, "title")
    assert lines[0] == "title" and lines[-1].startswith("turns >= 2") and "85.7%" in lines[-1]
    same = counter_delta(snaps[1], snaps[1])
    assert same["prefill"]["prompt_tokens"] == 0


def test_nothing_looked_up_is_no_rate_rather_than_zero():
    snaps = [sum_counters(_workers(0, 0, 0, 0, 0, 0))] * 2
    (row,) = multiturn_rows([_rec("c0", 1, 0.1)], snaps)
    assert row["prefill_hit_rate"] is None and row["decode_hit_rate"] is None
    assert "-" in table_lines([row])[1]


def _result(ttft_later, sent_later, outputs, hit=None, label="turns >= 2"):
    return {"workload": "multiturn", "outputs": outputs,
            "rows": [{"label": label, "ttft_p50_ms": ttft_later, "kv_bytes_sent_per_request": sent_later,
                      "prefill_hit_rate": hit, "decode_hit_rate": None}]}


def test_verdicts_of_caching_on_against_off():
    outs = {"c0/1": "a", "c0/2": "b", "c1/1": "c", "c1/2": "d"}
    off = _result(900.0, 1_000_000, outs)
    good = multiturn_verdicts("1p1d", off, _result(300.0, 150_000, dict(outs)))
    assert [v["verdict"] for v in good] == ["PASS", "PASS", "PASS"]
    assert "3.00x" in good[0]["detail"] and "85.0%" in good[1]["detail"]
    bad = multiturn_verdicts("1p1d", off, _result(400.0, 300_000, {**outs, "c1/1": "x", "c0/2": "y"}))
    assert [v["verdict"] for v in bad] == ["FAIL", "FAIL", "FAIL"]
    assert "2 of 4" in bad[2]["detail"] and "first c1/1" in bad[2]["detail"]
    assert [v["verdict"] for v in multiturn_verdicts("2p2d", off, None)] == ["n/a"] * 3


def test_compare_outputs_orders_by_turn_and_counts_missing_keys():
    diff = compare_outputs({"c0/1": "a", "c0/2": "b", "c1/2": "q"}, {"c0/1": "a", "c0/2": "B"})
    assert diff["compared"] == 3 and diff["differing"] == 2
    assert diff["first"] == {"key": "c0/2", "a": "b", "b": "B"}
    assert compare_outputs({"c0/1": "a"}, {"c0/1": "a"})["first"] is None


def test_shared_prefix_verdict_wants_more_hits_and_no_slower_ttft():
    load = _result(800.0, 0, {}, hit=0.3, label="all")
    assert shared_prefix_verdict(load, _result(500.0, 0, {}, hit=0.7, label="all"))["verdict"] == "PASS"
    assert shared_prefix_verdict(load, _result(900.0, 0, {}, hit=0.7, label="all"))["verdict"] == "FAIL"
    assert shared_prefix_verdict(load, None)["verdict"] == "n/a"
