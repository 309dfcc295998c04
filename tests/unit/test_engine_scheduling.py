"""The prefill scheduler's two rules (`engine.scheduling`): highest response ratio next, and a
pass that stops taking prompts at the throughput knee."""

from __future__ import annotations

import pytest

from engine.scheduling import CPU_BATCH_TOKENS, PassBudget, RateMeter, by_response_ratio, default_batch_tokens


def _order(jobs, now, rate=500.0):
    """jobs: (name, queued_at, remaining tokens)."""
    return [j[0] for j in by_response_ratio(jobs, now, rate, lambda j: j[1], lambda j: j[2])]


def test_prompts_arriving_together_run_shortest_first_and_ties_keep_arrival_order():
    burst = [("long", 0.0, 900), ("mid", 0.0, 300), ("short", 0.0, 40), ("short2", 0.0, 40)]
    assert _order(burst, now=0.0) == ["long", "mid", "short", "short2"]   # nobody waited: all ratios 1
    assert _order(burst, now=0.1) == ["short", "short2", "mid", "long"]


def test_a_long_prompt_overtakes_fresh_short_ones_once_it_waited_its_own_service_time():
    # 512 tok/s: the long prompt's service is 2 s and it waited 2 s: ratio 2 (exact binary fractions)
    long_, fresh = ("long", 0.0, 1024), ("short", 2.0 - 1 / 128, 8)   # waited half its service: 1.5
    assert _order([fresh, long_], now=2.0, rate=512.0) == ["long", "short"]
    tied = ("short", 2.0 - 1 / 64, 8)                                  # waited its service: ratio 2 too
    assert _order([tied, long_], now=2.0, rate=512.0) == ["short", "long"]   # equal ratios keep order
    assert _order([long_, tied], now=2.0, rate=512.0) == ["long", "short"]


def test_response_ratio_arguments_are_checked():
    with pytest.raises(ValueError):
        by_response_ratio([], 0.0, 0.0, lambda j: 0.0, lambda j: 1)
    # a zero remaining count (never given by the worker) does not divide by zero
    assert _order([("a", 0.0, 0), ("b", 0.0, 5)], now=1.0) == ["a", "b"]


def test_a_pass_takes_one_long_prompt_alone_and_short_ones_whole_up_to_the_knee():
    b = PassBudget(max_tokens=2048, batch_tokens=128)
    assert b.take(600) == 600 and b.full                 # past the knee: nobody joins
    assert b.take(10) == 0
    b = PassBudget(max_tokens=2048, batch_tokens=128)
    assert b.take(3000) == 2048 and b.full               # chunked at max_tokens
    b = PassBudget(max_tokens=2048, batch_tokens=128)
    assert [b.take(n) for n in (40, 40, 40)] == [40, 40, 40] and not b.full and b.used == 120
    assert b.take(85) == 0 and b.full                    # does not fit whole: closes the pass
    assert b.take(5) == 0 and b.used == 120              # nobody behind it overtakes it
    b = PassBudget(max_tokens=2048, batch_tokens=128)
    assert b.take(100) == 100 and b.take(28) == 28 and b.full   # exactly at the knee


def test_batch_tokens_above_max_tokens_is_max_tokens_and_sizes_are_checked():
    b = PassBudget(max_tokens=64, batch_tokens=4096)
    assert b.batch_tokens == 64 and b.take(30) == 30 and b.take(40) == 0 and b.full
    for bad in ((0, 128), (128, 0)):
        with pytest.raises(ValueError):
            PassBudget(*bad)


def test_the_default_knee_is_the_cpu_measurement_on_cpu_and_one_pass_on_cuda():
    assert default_batch_tokens("cpu", 2048) == CPU_BATCH_TOKENS == 128
    assert default_batch_tokens("cpu", 64) == 64
    assert default_batch_tokens("cuda:0", 2048) == 2048


def test_the_rate_meter_moves_toward_measured_passes_and_ignores_empty_ones():
    m = RateMeter(initial=500.0, alpha=0.5)
    m.add(1000, 1.0)
    assert m.tokens_per_s == 750.0
    m.add(0, 1.0)
    m.add(100, 0.0)
    assert m.tokens_per_s == 750.0
