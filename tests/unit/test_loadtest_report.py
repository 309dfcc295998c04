"""Config validation, CLI parsing, request bodies, the summary table, JSON and sweep tables."""

import json
import math

import pytest

from loadtest.cli import build_parser, config_from_args, parse_goodput, parse_headers
from loadtest.client import build_payload, chunk_text
from loadtest.config import BenchmarkConfig
from loadtest.errors import ConfigError
from loadtest.report import result_filename, save_result, summary_lines
from loadtest.sample import SampleRequest
from loadtest.sweep import sweep_row, sweep_table

pytestmark = pytest.mark.unit
URL = "http://127.0.0.1:9"


@pytest.mark.parametrize("kw", [dict(base_url="127.0.0.1:8000"), dict(endpoint="/v1/embeddings"),
                                dict(num_prompts=0), dict(request_rate=0),
                                dict(random_range_ratio=1.0), dict(max_concurrency=0),
                                dict(goodput_slos_ms={"itl": 5}), dict(metric_percentiles=(101,)),
                                dict(arrival="uniform"), dict(dataset="sonnet")])
def test_config_rejects(kw):
    with pytest.raises(ConfigError):
        BenchmarkConfig(**{"base_url": URL, "model": "m", **kw})


def test_cli_flags_build_the_config():
    args = build_parser().parse_args(
        ["--base-url", URL, "--model", "m", "--request-rate", "4", "--burstiness", "0.5",
         "--max-concurrency", "8", "--goodput", "ttft:500", "tpot:50", "--header", "A=b",
         "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,e2el",
         "--no-ignore-eos", "--extra-body", '{"top_k": 1}'])
    c = config_from_args(args)
    assert (c.request_rate, c.arrival, c.burstiness, c.max_concurrency) == (4.0, "gamma", 0.5, 8)
    assert c.goodput_slos_ms == {"ttft": 500.0, "tpot": 50.0} and c.headers == {"A": "b"}
    assert c.metric_percentiles == (50.0, 99.9) and c.percentile_metrics == ("ttft", "e2el")
    assert c.ignore_eos is False and c.extra_body == {"top_k": 1}
    default = config_from_args(build_parser().parse_args(["--base-url", URL, "--model", "m"]))
    assert math.isinf(default.request_rate) and default.arrival == "poisson"
    assert parse_headers(["K=v=w"]) == {"K": "v=w"}
    for bad in (["ttft"], ["ttft:x"]):
        with pytest.raises(ConfigError):
            parse_goodput(bad)


def test_request_bodies():
    sample = SampleRequest("hello there", 2, 7)
    c = BenchmarkConfig(base_url=URL + "/", model="m", temperature=0.0)
    body = build_payload(c, sample)
    assert c.url == URL + "/v1/completions"
    assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                    "prompt": "hello there", "max_tokens": 7, "ignore_eos": True,
                    "temperature": 0.0}
    chat = BenchmarkConfig(base_url=URL, model="m", endpoint="/v1/chat/completions",
                           dataset="sharegpt")
    body = build_payload(chat, sample)
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_completion_tokens"] == 7 and "ignore_eos" not in body
    assert chunk_text({"text": "a"}) == "a" and chunk_text({"delta": {"content": "b"}}) == "b"
    assert chunk_text({"delta": {"role": "assistant"}}) == ""


def _result(**kw):
    r = {"completed": 9, "failed": 1, "max_concurrency": 4, "request_rate": 2.0,
         "duration": 5.0, "total_input_tokens": 900, "total_output_tokens": 90,
         "request_throughput": 1.8, "request_goodput": 1.6, "goodput_ratio": 0.8,
         "output_throughput": 18.0, "max_output_tokens_per_s": 30.0,
         "max_concurrent_requests": 4, "total_token_throughput": 198.0,
         "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0, "std_ttft_ms": 5.0, "p99_ttft_ms": 150.0,
         "errors": [""] * 9 + ["HTTP 503: overloaded\ntrace"], "label": "disagg",
         "model_id": "org/model", "date": "20260101-000000"}
    r.update(kw)
    return r


def test_summary_table_like_vllm():
    text = "\n".join(summary_lines(_result(), ("ttft", "tpot"), (99,)))
    for line in ("Successful requests:                     9",
                 "Request rate configured (RPS):           2.00",
                 "Request goodput (req/s):                 1.60",
                 "Median TTFT (ms):                        90.00",
                 "P99 TTFT (ms):                           150.00",
                 "  HTTP 503: overloaded"):
        assert line in text
    assert "TPOT" not in text  # not in the result: skipped
    assert "goodput" not in "\n".join(summary_lines(_result(request_goodput=None)))


def test_save_result_uses_vllm_file_name(tmp_path):
    r = _result(request_rate=math.inf, max_concurrency=None, label=None, backend="openai")
    assert result_filename(r) == "openai-infqps-model-20260101-000000.json"
    assert result_filename(_result()) == "disagg-2.0qps-concurrency4-model-20260101-000000.json"
    path = save_result(r, tmp_path / "out")
    assert json.loads(path.read_text())["request_rate"] == "inf"


def test_sweep_table_and_verdict():
    rows = [sweep_row(_result(request_rate=1.0, goodput_ratio=0.95), 0.9),
            sweep_row(_result(request_rate=2.0, goodput_ratio=0.5), 0.9)]
    assert [r["meets_slo"] for r in rows] == [True, False]
    text = sweep_table({"threshold": 0.9, "goodput": {"ttft": 500.0}, "rows": rows,
                        "max_rate_meeting_slo": 1.0})
    assert "Highest rate meeting SLOs (ttft:500ms, goodput >= 90%): 1 req/s" in text
    assert len(text.splitlines()) == 4
