"""Metrics on synthetic timings: vLLM's TTFT/TPOT/ITL/E2EL, throughputs, goodput."""

import numpy as np
import pytest

from loadtest.client import RequestOutput
from loadtest.metrics import (chunks_per_second, compute_metrics, is_good, peak_concurrency,
                              percentile_key, tpot_s)

pytestmark = pytest.mark.unit


def _out(start, ttft, itl, tokens=None, prompt=10, ok=True, error=""):
    latency = ttft + sum(itl)
    return RequestOutput(prompt_len=prompt, output_tokens=len(itl) + 1 if tokens is None else tokens,
                         success=ok, error=error if not ok else "", start_time=start, ttft=ttft,
                         itl=list(itl), latency=latency, chunks=len(itl) + 1)


def test_tpot_is_latency_after_first_token_per_later_token():
    o = _out(0.0, 0.1, [0.02] * 4)  # 5 tokens, E2EL 0.18
    assert tpot_s(o) == pytest.approx((0.18 - 0.1) / 4)
    o.output_tokens = 9  # usage says 9 tokens in 5 chunks: TPOT uses tokens, not chunks
    assert tpot_s(o) == pytest.approx(0.08 / 8)
    assert tpot_s(_out(0.0, 0.1, [])) == 0.0


def test_compute_metrics_definitions():
    outs = [_out(100.0, 0.1, [0.02, 0.02, 0.02], prompt=10),
            _out(100.5, 0.3, [0.04, 0.04, 0.04, 0.04], prompt=20),
            _out(101.0, 0.0, [], tokens=0, prompt=5, ok=False, error="HTTP 500: boom")]
    r = compute_metrics(outs, duration_s=2.0, origin=100.0, percentiles=(50, 99.9))
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_input_tokens"] == 30 and r["total_output_tokens"] == 9
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(4.5)
    assert r["total_token_throughput"] == pytest.approx(19.5)
    assert r["request_goodput"] is None and r["goodput_ratio"] is None
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(100.0)  # population std, as numpy / vLLM
    assert r["mean_tpot_ms"] == pytest.approx(30.0)
    assert r["mean_itl_ms"] == pytest.approx((3 * 20 + 4 * 40) / 7)
    assert r["median_itl_ms"] == pytest.approx(40.0)
    assert r["mean_e2el_ms"] == pytest.approx((160 + 460) / 2)
    assert r["p99.9_e2el_ms"] == pytest.approx(np.percentile([160, 460], 99.9))
    assert r["p50_itl_ms"] == pytest.approx(40.0)
    assert r["input_lens"] == [10, 20, 5] and r["output_lens"] == [4, 5, 0]
    assert r["start_times"] == pytest.approx([0.0, 0.5, 1.0])
    assert r["errors"] == ["", "", "HTTP 500: boom"]
    assert r["max_concurrent_requests"] == 1  # [100, 100.16) and [100.5, 100.96)
    assert r["max_output_tokens_per_s"] == 9.0


def test_goodput_counts_requests_within_every_slo():
    outs = [_out(0.0, 0.1, [0.02] * 9),   # ttft 100 ms, tpot 20 ms, e2el 280 ms
            _out(0.0, 0.6, [0.02] * 9),   # ttft too slow
            _out(0.0, 0.1, [0.08] * 9),   # tpot too slow
            _out(0.0, 0.05, []),          # one token: tpot counts as 0
            _out(0.0, 0.0, [], ok=False, error="x")]
    slos = {"ttft": 500, "tpot": 50}
    assert [is_good(o, slos) for o in outs] == [True, False, False, True, False]
    r = compute_metrics(outs, duration_s=4.0, slos_ms=slos)
    assert r["request_goodput"] == pytest.approx(2 / 4.0)
    assert r["goodput_ratio"] == pytest.approx(2 / 5)
    assert is_good(outs[0], {"e2el": 280.0001}) and not is_good(outs[0], {"e2el": 279})


def test_empty_samples_report_zero_and_selected_metrics_only():
    r = compute_metrics([_out(0.0, 0.0, [], ok=False, error="x")], 1.0,
                        percentile_metrics=("ttft",), percentiles=(90,))
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0.0 and r["p90_ttft_ms"] == 0.0
    assert "mean_tpot_ms" not in r and "mean_itl_ms" not in r
    assert r["max_output_tokens_per_s"] == 0.0 and r["max_concurrent_requests"] == 0


def test_timeline_helpers():
    buckets = chunks_per_second([0.0, 0.5], [0.2, 0.2], [[0.5, 0.5], [0.1]])
    # chunks at 0.2, 0.7, 1.2 and 0.7, 0.8
    assert buckets.tolist()[:2] == [4, 1]
    assert peak_concurrency([0.0, 1.0, 1.0, 2.0], [1.0, 0.5, 1.5, 1.0]) == 2  # half-open
    assert percentile_key("ttft", 99.0) == "p99_ttft_ms"
    assert percentile_key("itl", 99.9) == "p99.9_itl_ms"
