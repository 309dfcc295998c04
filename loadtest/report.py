"""Text summary and JSON files of a run's result dict (vLLM's layout and names)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from loadtest.metrics import percentile_key

WIDTH = 50
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"),
                 "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"),
                 "e2el": ("E2EL", "End-to-end Latency")}


def _row(name: str, value: object) -> str:
    if isinstance(value, float):
        return f"{name:<40} {value:<10.2f}"
    return f"{name:<40} {value!s:<10}"


def summary_lines(result: dict, percentile_metrics: Sequence[str] = tuple(METRIC_TITLES),
                  percentiles: Sequence[float] = (50.0, 90.0, 99.0)) -> list[str]:
    """The summary table, as ``vllm bench serve`` prints it, one string per line."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_row("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [_row("Benchmark duration (s):", float(result["duration"])),
              _row("Total input tokens:", result["total_input_tokens"]),
              _row("Total generated tokens:", result["total_output_tokens"]),
              _row("Request throughput (req/s):", float(result["request_throughput"]))]
    if result.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", float(result["request_goodput"])))
    lines += [_row("Output token throughput (tok/s):", float(result["output_throughput"])),
              _row("Peak output token throughput (tok/s):",
                   float(result["max_output_tokens_per_s"])),
              _row("Peak concurrent requests:", float(result["max_concurrent_requests"])),
              _row("Total token throughput (tok/s):", float(result["total_token_throughput"]))]
    for metric in percentile_metrics:
        lines += _metric_lines(result, metric, percentiles)
    lines += _error_lines(result)
    lines.append("=" * WIDTH)
    return lines


def _metric_lines(result: dict, metric: str, percentiles: Sequence[float]) -> list[str]:
    if f"mean_{metric}_ms" not in result:
        return []
    short, header = METRIC_TITLES[metric]
    lines = [header.center(WIDTH, "-"),
             _row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"]),
             _row(f"Median {short} (ms):", result[f"median_{metric}_ms"])]
    for p in percentiles:
        key = percentile_key(metric, p)
        if key in result:
            lines.append(_row(f"{key.split('_')[0].upper()} {short} (ms):", result[key]))
    return lines


def _error_lines(result: dict, limit: int = 5) -> list[str]:
    errors = [e for e in result.get("errors", []) if e]
    if not errors:
        return []
    lines = [f"Errors (first {min(limit, len(errors))} of {len(errors)})".center(WIDTH, "-")]
    return lines + [f"  {e.splitlines()[0][:200]}" for e in errors[:limit]]


def print_summary(result: dict, percentile_metrics: Sequence[str] = tuple(METRIC_TITLES),
                  percentiles: Sequence[float] = (50.0, 90.0, 99.0)) -> None:
    """Print ``summary_lines`` to stdout."""
    print("\n".join(summary_lines(result, percentile_metrics, percentiles)))


def result_filename(result: dict) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    label = result.get("label") or result.get("backend") or "openai"
    conc = result.get("max_concurrency")
    conc_part = f"-concurrency{conc}" if conc is not None else ""
    model = str(result.get("model_id", "model")).split("/")[-1]
    return f"{label}-{result.get('request_rate')}qps{conc_part}-{model}-{result.get('date')}.json"


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(data: dict | list, path: str | Path) -> Path:
    """Write ``data`` as JSON (infinite floats as strings), creating parent dirs; returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cleaned = {k: _finite(v) for k, v in data.items()} if isinstance(data, dict) else data
    path.write_text(json.dumps(cleaned, indent=2) + "\n")
    return path


def save_result(result: dict, result_dir: str | Path, filename: str | None = None) -> Path:
    """Write a run's result to ``result_dir/filename`` (default ``result_filename``)."""
    return write_json(result, Path(result_dir) / (filename or result_filename(result)))
