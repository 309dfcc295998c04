"""What `loadtest.peers` reports: the markdown table (a row per concurrency and server, then the
pdserve/peer ratios) and the machine record written beside the runs in the JSON file."""

from __future__ import annotations

import os
from pathlib import Path

from loadtest.peer_servers import PDSERVE


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ""


def table(runs: dict[str, dict[int, dict]], levels: list[int]) -> list[str]:
    """One markdown row per (concurrency, server), then the pdserve/peer ratios if pdserve ran."""
    lines = ["| concurrency | server | ok / failed | output tok/s | req/s | TTFT p50 (ms) | "
             "TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | mean output tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        for name, by_level in runs.items():
            r = by_level.get(c, {}).get("result")
            if r is None:
                lines.append(f"| {c} | {name} | error | | | | | | | |")
                continue
            mean_out = r["total_output_tokens"] / r["completed"] if r["completed"] else 0.0
            lines.append(f"| {c} | {name} | {r['completed']} / {r['failed']} | "
                         f"{r['output_throughput']:.1f} | {r['request_throughput']:.3f} | "
                         f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                         f"{r['median_tpot_ms']:.1f} | {_fmt(r.get('median_itl_ms'), '.1f')} | "
                         f"{mean_out:.1f} |")
    peers = [n for n in runs if n != PDSERVE]
    if PDSERVE not in runs or not peers:
        return lines
    lines += ["", "pdserve vs each peer (pdserve / peer)", "",
              "| concurrency | peer | output tok/s | TTFT p50 | TPOT p50 |", "|---|---|---|---|---|"]
    for c in levels:
        mine = runs[PDSERVE].get(c, {}).get("result")
        for name in peers:
            theirs = runs[name].get(c, {}).get("result")
            if mine is None or theirs is None:
                lines.append(f"| {c} | {name} | | | |")
                continue
            lines.append(f"| {c} | {name} | "
                         f"{_ratio(mine['output_throughput'], theirs['output_throughput'])} | "
                         f"{_ratio(mine['median_ttft_ms'], theirs['median_ttft_ms'])} | "
                         f"{_ratio(mine['median_tpot_ms'], theirs['median_tpot_ms'])} |")
    return lines


def machine() -> dict:
    """This machine's CPU model, the CPUs this process may use, and the SIMD flags that matter."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": model, "nproc": nproc,
            "flags": {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
                      "amx": any(f.startswith("amx") for f in flags)}}
