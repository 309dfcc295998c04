"""``python -m loadtest.bars``: the engine issue's acceptance bars, checked on `loadtest.peers` results.

The served bars of the engine issue ("Engine speed: catch vLLM's CPU backend on the same cores";
its others, greedy equality with compilation on and off, the warm restart and the kernel's tests,
are tests and benchmarks of their own) are met when one run on one machine, every server alone on
the same two cores, gives (`BARS`):

- `pdserve up` as it starts by default, 32 in flight: output tok/s >= 1.0x the reference's, TPOT
  p50 <= 1.0x, TTFT p99 <= 1.0x; one request in flight: TPOT p50 <= 1.0x, TTFT p50 <= 1.5x;
- one prefill and one decode worker, a core each (the pair), 32 in flight: output tok/s >= 0.8x;
  on the prefill-heavy mix (1024 +-50% prompt tokens, 16 in flight): TPOT p99 below the reference's;
- colocated on two threads against colocated on one, 32 in flight: output tok/s >= 1.6x.

The reference is vLLM's CPU backend (``--reference``, default the server named ``vllm``). Where it
cannot run (its wheel needs AVX-512) another peer may stand in (``--reference llama-server``): the
table then says the verdict is not the issue's.

Two `loadtest.peers` runs feed it, on the mixes `MAIN_MIX` and `HEAVY_MIX` (the command lines are
in loadtest/README.md, "Acceptance bars of the engine issue"). Servers are found by name: the default
``pdserve`` (``--default``), ``1p1d`` (``--pair``: `pdserve up --serving-mode disaggregated`; the
default, in auto mode, computes some prompts on its decode worker, so it does not stand for the
pair), ``colo2`` and ``colo1`` (``--colo2``, ``--colo1``). A bar whose server, level or reference is
missing, or whose runs had failed requests, is reported as not met, with the reason.

    python -m loadtest.bars MAIN.json [HEAVY.json] [--reference NAME] [--json OUT]

Prints one markdown table (a row per bar) and, with ``--json``, writes the rows. Exit code 0 when
every bar is met, 1 when one is not (or was not measured), 2 for unreadable files or a run of another
workload (the field named). Imports no project code, as the rest of `loadtest`.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.peer_report import _fmt
from loadtest.report import write_json

MAIN_MIX = {"input_len": 256, "range_ratio": 0.5, "output_len": 64, "seed": 7,
            "endpoint": "/v1/chat/completions"}
"""The workload of the bars at 1 and 32 in flight (`loadtest.peers` settings)."""
HEAVY_MIX = {**MAIN_MIX, "input_len": 1024}
"""The prefill-heavy workload, at 16 in flight."""

_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Bar:
    """One acceptance bar: ``metric`` of ``role``'s run at ``level`` in flight, on the ``mix``
    ("main" or "heavy") run, compared by ``op`` with ``factor`` times the same metric of
    ``against`` ("reference" or another role) at the same level."""
    name: str
    mix: str
    role: str
    level: int
    metric: str
    against: str
    op: str
    factor: float


BARS = (
    Bar("`pdserve up`, 32 in flight: output tok/s", "main", "default", 32, "output_throughput", "reference", ">=", 1.0),
    Bar("`pdserve up`, 32 in flight: TPOT p50", "main", "default", 32, "median_tpot_ms", "reference", "<=", 1.0),
    Bar("`pdserve up`, 32 in flight: TTFT p99", "main", "default", 32, "p99_ttft_ms", "reference", "<=", 1.0),
    Bar("`pdserve up`, one request: TPOT p50", "main", "default", 1, "median_tpot_ms", "reference", "<=", 1.0),
    Bar("`pdserve up`, one request: TTFT p50", "main", "default", 1, "median_ttft_ms", "reference", "<=", 1.5),
    Bar("1P1D, 32 in flight: output tok/s", "main", "pair", 32, "output_throughput", "reference", ">=", 0.8),
    Bar("1P1D, prefill-heavy mix: TPOT p99", "heavy", "pair", 16, "p99_tpot_ms", "reference", "<", 1.0),
    Bar("colocated 2 threads vs 1, 32 in flight: output tok/s", "main", "colo2", 32, "output_throughput", "colo1",
        ">=", 1.6),
)


@dataclass
class Verdict:
    """A bar's outcome: the two servers' values (None where missing) in the metric's unit
    (milliseconds for TTFT / TPOT, output tokens per second for throughput: `loadtest.metrics`'
    result fields), ``ratio`` = value / other, ``met`` (False also when not measured) and, when
    not measured, ``reason``."""
    bar: str
    server: str
    value: float | None
    against: str
    other: float | None
    ratio: float | None
    target: str
    met: bool
    reason: str = ""


def load_run(path: str | Path, mix: dict) -> dict:
    """A `loadtest.peers` JSON file, checked to be of ``mix``.
    Raises:
        ValueError: unreadable, not a peers record, or a setting other than ``mix``'s (named)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(record, dict) or not isinstance(record.get("runs"), dict) \
            or not isinstance(record.get("settings"), dict):
        raise ValueError(f"{path}: not a loadtest.peers result (no 'runs' and 'settings')")
    for field, want in mix.items():
        got = record["settings"].get(field)
        if got != want:
            raise ValueError(f"{path}: settings.{field} is {got!r}; the bars' workload has {want!r}")
    return record


def _result(record: dict | None, server: str, level: int) -> tuple[dict | None, str]:
    """``(result, "")`` for ``server``'s run at ``level``, or ``(None, why not)``."""
    if record is None:
        return None, "no prefill-heavy run given"
    runs = record["runs"].get(server)
    if runs is None:
        flags = record.get("machine", {}).get("flags", {})
        if server == "vllm" and flags.get("avx512f") is False:
            return None, "vLLM's CPU wheel needs AVX-512; this run's CPU has none"
        return None, f"no server {server!r} in the run"
    result = (runs.get(str(level)) or {}).get("result")
    if result is None:
        return None, f"{server!r} has no result at {level} in flight"
    if result.get("failed"):
        return None, f"{server!r} failed {result['failed']} requests at {level} in flight"
    return result, ""


def evaluate(main: dict, heavy: dict | None = None, reference: str = "vllm", default: str = "pdserve",
             pair: str = "1p1d", colo2: str = "colo2", colo1: str = "colo1") -> list[Verdict]:
    """Every bar of `BARS` on the two runs (records as `load_run` returns them; ``heavy`` may be
    None: its bar is then not measured). Server names as the module docstring says."""
    roles = {"default": default, "pair": pair, "colo2": colo2, "colo1": colo1, "reference": reference}
    verdicts = []
    for bar in BARS:
        record = main if bar.mix == "main" else heavy
        server, other_server = roles[bar.role], roles[bar.against]
        mine, why = _result(record, server, bar.level)
        theirs, why_other = _result(record, other_server, bar.level)
        value = mine[bar.metric] if mine else None
        other = theirs[bar.metric] if theirs else None
        ratio = value / other if value is not None and other else None
        met = ratio is not None and _OPS[bar.op](ratio, bar.factor)
        verdicts.append(Verdict(bar.name, server, value, other_server, other, ratio,
                                f"{bar.op} {bar.factor:g}x", met, why or why_other))
    return verdicts


def table(verdicts: list[Verdict], reference: str = "vllm") -> list[str]:
    """The verdicts as markdown lines, with a note when the reference is not vLLM."""
    lines = ["| bar | server | value | against | its value | ratio | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        met = "yes" if v.met else ("no" if not v.reason else f"not measured: {v.reason}")
        ratio = "" if v.ratio is None else f"{v.ratio:.2f}x"
        lines.append(f"| {v.bar} | {v.server} | {_fmt(v.value, '.1f')} | {v.against} | "
                     f"{_fmt(v.other, '.1f')} | {ratio} | {v.target} | {met} |")
    if reference != "vllm":
        lines += ["", f"The reference here is {reference!r}, not vLLM: these are not the engine issue's bars."]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bars", description=__doc__.splitlines()[0])
    p.add_argument("main", help="peers JSON of the 256-token mix at 1 and 32 in flight")
    p.add_argument("heavy", nargs="?", help="peers JSON of the prefill-heavy mix at 16 in flight")
    p.add_argument("--reference", default="vllm", help="the server the bars compare with")
    p.add_argument("--default", default="pdserve", help="the server started as `pdserve up` starts")
    p.add_argument("--pair", default="1p1d", help="one prefill and one decode worker, a core each")
    p.add_argument("--colo2", default="colo2", help="colocated, one worker on two threads")
    p.add_argument("--colo1", default="colo1", help="colocated, one worker on one thread")
    p.add_argument("--json", help="write the verdicts here")
    args = p.parse_args(argv)
    try:
        main_run = load_run(args.main, MAIN_MIX)
        heavy_run = load_run(args.heavy, HEAVY_MIX) if args.heavy else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verdicts = evaluate(main_run, heavy_run, args.reference, args.default, args.pair, args.colo2, args.colo1)
    print("\n".join(table(verdicts, args.reference)))
    if args.json:
        record = {"inputs": [args.main, args.heavy], "reference": args.reference,
                  "machine": main_run.get("machine"), "verdicts": [asdict(v) for v in verdicts]}
        print(f"wrote {write_json(record, args.json)}")
    return 0 if all(v.met for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
