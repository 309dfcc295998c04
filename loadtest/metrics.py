"""Benchmark metrics with vLLM's definitions and JSON field names.

Source: ``calculate_metrics`` and ``benchmark`` in vllm/benchmarks/serve.py (``vllm bench
serve``). Per successful request (seconds in, milliseconds out where the name ends in ``_ms``):

- TTFT = first content chunk time - send time.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with output_tokens > 1
  (for goodput a request with <= 1 output token counts TPOT as 0).
- ITL = every gap between consecutive content chunks, pooled over all requests.
- E2EL = last content chunk time - send time.

Over the run (``duration`` = wall time from the first scheduled send to the last completion, s):
``request_throughput = completed / duration``, ``output_throughput = total_output_tokens /
duration``, ``total_token_throughput = (total_input_tokens + total_output_tokens) / duration``,
``request_goodput = good requests / duration`` where a good request meets every SLO given
(``SLO_ms / 1000 >= value_s``); ``None`` without SLOs. Failed requests count 0 output tokens and
are never good. Statistics are numpy mean / median / std (population) / percentile (linear),
0 when there is no sample. ``max_output_tokens_per_s`` is the fullest one-second bucket of content
chunks and ``max_concurrent_requests`` the peak overlap of successful requests, as in vLLM.

Differences from vLLM's JSON: an added ``goodput_ratio`` (good / requests sent, used by the sweep),
and ``start_times`` are seconds after the run's start rather than raw perf_counter values.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from loadtest.client import RequestOutput


def tpot_s(output: RequestOutput) -> float:
    """TPOT of one request, s; 0.0 when it has at most one output token."""
    if output.output_tokens <= 1:
        return 0.0
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def percentile_key(metric: str, p: float) -> str:
    """vLLM's field name for a percentile: ``p99_ttft_ms``, ``p99.9_ttft_ms``."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def summarize_ms(metric: str, values_s: Sequence[float],
                 percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/percentile fields of ``values_s`` (seconds) in ms, 0 when empty."""
    arr = np.asarray(values_s, dtype=float) if len(values_s) else np.zeros(1)
    out = {f"mean_{metric}_ms": float(np.mean(arr)) * 1000,
           f"median_{metric}_ms": float(np.median(arr)) * 1000,
           f"std_{metric}_ms": float(np.std(arr)) * 1000}
    for p in percentiles:
        out[percentile_key(metric, p)] = float(np.percentile(arr, p)) * 1000
    return out


def is_good(output: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a request meets every SLO (ms) in ``slos_ms``; failed requests never do."""
    if not output.success:
        return False
    values = {"ttft": output.ttft, "tpot": tpot_s(output), "e2el": output.latency}
    return all(limit / 1000.0 >= values[name] for name, limit in slos_ms.items())


def chunk_times(start: float, ttft: float, itl: Sequence[float]) -> np.ndarray:
    """Arrival times of a request's content chunks, s, on the clock of ``start``."""
    return start + ttft + np.concatenate(([0.0], np.cumsum(itl, dtype=float)))


def chunks_per_second(starts: Sequence[float], ttfts: Sequence[float],
                      itls: Sequence[Sequence[float]], origin: float | None = None) -> np.ndarray:
    """Content chunks received in each one-second bucket after ``origin`` (default: the
    earliest start, as vLLM's output-tokens-per-second series); empty without requests."""
    if not starts:
        return np.zeros(0)
    times = [chunk_times(s, t, i) for s, t, i in zip(starts, ttfts, itls)]
    origin = min(starts) if origin is None else origin
    last = max(float(t[-1]) for t in times)
    buckets = np.zeros(int(np.ceil(last - origin)) + 1)
    for t in times:
        np.add.at(buckets, (t - origin).astype(int), 1)
    return buckets


def peak_concurrency(starts: Sequence[float], latencies: Sequence[float]) -> int:
    """Most requests in flight at once over half-open intervals ``[start, start + latency)``."""
    events = sorted([(s, 1) for s in starts] + [(s + lat, -1) for s, lat in zip(starts, latencies)])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float, origin: float = 0.0,
                    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el"),
                    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
                    slos_ms: dict[str, float] | None = None) -> dict:
    """The result dict of a run (vLLM's field names), see the module docstring.

    ``origin`` is the perf_counter value of the run's start; ``start_times`` are relative to it.
    """
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(output_lens)
    good = sum(is_good(o, slos_ms) for o in outputs) if slos_ms else 0
    samples = {"ttft": [o.ttft for o in ok],
               "tpot": [tpot_s(o) for o in ok if o.output_tokens > 1],
               "itl": [gap for o in ok for gap in o.itl],
               "e2el": [o.latency for o in ok]}
    result = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slos_ms else None,
        "goodput_ratio": good / len(outputs) if slos_ms and outputs else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for name in percentile_metrics:
        result.update(summarize_ms(name, samples[name], percentiles))
    buckets = chunks_per_second([o.start_time for o in ok], samples["ttft"], [o.itl for o in ok])
    result["max_output_tokens_per_s"] = float(buckets.max()) if buckets.size else 0.0
    result["max_concurrent_requests"] = peak_concurrency([o.start_time for o in ok],
                                                         samples["e2el"])
    result.update(per_request_arrays(outputs, output_lens, origin))
    return result


def per_request_arrays(outputs: Sequence[RequestOutput], output_lens: list[int],
                       origin: float) -> dict:
    """vLLM's per-request arrays (seconds), one entry per request sent, in send order."""
    return {"input_lens": [o.prompt_len for o in outputs],
            "output_lens": output_lens,
            "ttfts": [o.ttft for o in outputs],
            "itls": [o.itl for o in outputs],
            "latencies": [o.latency for o in outputs],
            "start_times": [o.start_time - origin for o in outputs],
            "errors": [o.error for o in outputs]}
