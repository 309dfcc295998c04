"""Rate sweep: the highest request rate at which the server still meets its SLOs.

Each rate runs the same workload (same seed, same prompts) as one benchmark. A rate *meets the
SLOs* when ``goodput_ratio`` = good requests / requests sent >= ``threshold`` (default 0.9), a
good request being one within every ``--goodput`` SLO (vLLM's goodput definition, see
``metrics``). Rates run in increasing order; by default the sweep stops after the first rate that
fails (latency only grows with load), so a sweep is bounded by ``len(rates)`` runs, each bounded
by ``num_prompts`` and ``max_duration_s``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from loadtest.config import BenchmarkConfig
from loadtest.datasets import sample_requests
from loadtest.errors import ConfigError
from loadtest.runner import run_benchmark

ROW_FIELDS = ("request_rate", "completed", "failed", "request_throughput", "request_goodput",
              "goodput_ratio", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
              "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms")


def sweep_row(result: dict, threshold: float) -> dict:
    """The summary of one rate's result, with ``meets_slo``."""
    row = {name: result.get(name) for name in ROW_FIELDS}
    row["meets_slo"] = (result.get("goodput_ratio") or 0.0) >= threshold
    return row


def run_sweep(config: BenchmarkConfig, rates: Sequence[float], threshold: float = 0.9,
              stop_on_failure: bool = True,
              on_result: Callable[[float, dict], None] | None = None) -> dict:
    """Run ``config`` at each of ``rates`` (req/s); returns ``{"threshold", "goodput",
    "max_rate_meeting_slo" (None if no rate did), "rows": [...]}``. ``on_result(rate, result)``
    sees each full result (to save or plot it). Raises ``ConfigError`` without SLOs."""
    if not config.goodput_slos_ms:
        raise ConfigError("a sweep needs SLOs: give goodput_slos_ms (--goodput ttft:500 ...)")
    if not rates or not 0 < threshold <= 1:
        raise ConfigError(f"need at least one rate and 0 < threshold <= 1: {rates}, {threshold}")
    requests = sample_requests(config)
    rows: list[dict] = []
    for rate in sorted(rates):
        result = run_benchmark(dataclasses.replace(config, request_rate=float(rate)), requests)
        if on_result is not None:
            on_result(rate, result)
        rows.append(sweep_row(result, threshold))
        if stop_on_failure and not rows[-1]["meets_slo"]:
            break
    passing = [row["request_rate"] for row in rows if row["meets_slo"]]
    return {"threshold": threshold, "goodput": dict(config.goodput_slos_ms),
            "max_rate_meeting_slo": max(passing) if passing else None, "rows": rows}


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def sweep_table(sweep: dict) -> str:
    """The sweep as a fixed-width text table, with the verdict line under it."""
    cols = ("request_rate", "completed", "failed", "request_throughput", "goodput_ratio",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "meets_slo")
    heads = ("rate", "done", "fail", "req/s", "good%", "ttft p50", "ttft p99", "tpot p50",
             "tpot p99", "SLO")
    lines = ["".join(f"{h:>10}" for h in heads)]
    for row in sweep["rows"]:
        cells = dict(row, goodput_ratio=100 * (row["goodput_ratio"] or 0.0),
                     meets_slo="yes" if row["meets_slo"] else "no")
        lines.append("".join(f"{_cell(cells[c]):>10}" for c in cols))
    best = sweep["max_rate_meeting_slo"]
    slos = " ".join(f"{k}:{v:g}ms" for k, v in sweep["goodput"].items())
    verdict = f"{best:g} req/s" if best is not None else "none of the rates"
    lines.append(f"Highest rate meeting SLOs ({slos}, goodput >= {sweep['threshold']:.0%}): "
                 f"{verdict}")
    return "\n".join(lines)
