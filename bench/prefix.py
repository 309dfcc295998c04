"""``python -m bench.prefix``: prefix caching on / off and routing policies, one run.

Runs the `loadtest.multiturn` workloads (same seed, same sizes) against fresh clusters
(`deploy.launcher`), one at a time:

    run                       cluster  workers           router                         workload
    multiturn/1p1d/off        1P + 1D  -                 --policy load                  multiturn
    multiturn/1p1d/on         1P + 1D  --prefix-caching  --policy kv                    multiturn
    multiturn/1p1d/on-nowarm  1P + 1D  --prefix-caching  --policy kv --no-prefill-warmup multiturn
    multiturn/1p1d/off-auto   1P + 1D  -                 --policy load, auto (below)    multiturn
    multiturn/1p1d/on-auto    1P + 1D  --prefix-caching  --policy kv, auto              multiturn
    multiturn/2p2d/off        2P + 2D  -                 --policy load                  multiturn
    multiturn/2p2d/on         2P + 2D  --prefix-caching  --policy kv                    multiturn
    multiturn/2p2d/off-auto   2P + 2D  -                 --policy load, auto            multiturn
    multiturn/2p2d/on-auto    2P + 2D  --prefix-caching  --policy kv, auto              multiturn
    shared-prefix/2p2d/off    (the multiturn/2p2d/off cluster, after its multiturn run)
    shared-prefix/2p2d/load   2P + 2D  --prefix-caching  --policy load                  shared-prefix
    shared-prefix/2p2d/kv     2P + 2D  --prefix-caching  --policy kv                    shared-prefix

"auto" is ``--serving-mode auto --colocated-threshold-tokens AUTO_THRESHOLD``: a request whose
tokens left to compute, past the prefix its decode worker holds, are fewer than the threshold is
prefilled on that decode worker (conditional disaggregation, `router.serving`); the rest
(long new messages) go through a prefill worker as in "on". With caching off the same rule
sees whole prompts: "off-auto" is its baseline (on-auto is compared with off and off-auto).
"on" runs the router's prefix-cache warm-ups (`router.warmup`: the prefill worker computes each
finished turn's answer into its cache when idle); "on-nowarm" shows the same without them (the
prefill worker then recomputes the previous answer on the next turn's critical path).

Lifecycle per cluster: start it, wait until every worker is connected, warm up, run its
workloads, stop it before the next one starts; every started cluster is stopped on an error or
Ctrl-C too. A cluster that fails to start is recorded and the others still run.

Verdicts (targets of the prefix-caching work): turns >= 2 TTFT p50 off / on >= 3x; KV bytes sent
per turn >= 2 request at least 80% lower on; greedy answers identical on and off (every
(conversation, turn)); shared-prefix: kv's prefill hit rate >= load's and TTFT p50 <= load's.
Exit status 0 when every run completed (whatever the verdicts), 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path

from bench.common import arg_parser, write_json
from deploy.launcher import Cluster, LauncherConfig
from loadtest.errors import LoadTestError
from loadtest.multiturn import (build_conversations, build_shared_prefix, cell, run_workload,
                                table_lines)
from loadtest.sharegpt import load_records

MODEL = "SmolLM2-135M-Instruct"
TTFT_TARGET = 3.0
KV_REDUCTION_TARGET = 0.8
AUTO_THRESHOLD = 256   # tokens: conditional disaggregation of the "on-auto" runs


@dataclass(frozen=True)
class Sizes:
    """Workload sizes (tokens approximate, 4 characters each)."""

    conversations: int = 8
    turns: int = 4
    user_tokens: int = 256
    groups: int = 4
    users_per_group: int = 6
    system_tokens: int = 400
    question_tokens: int = 64
    max_tokens: int = 128   # answers (SmolLM2 is verbose: most run to it)
    concurrency: int = 4


QUICK = Sizes(conversations=2, turns=2, user_tokens=64, groups=2, users_per_group=2,
              system_tokens=128, question_tokens=32, max_tokens=8, concurrency=2)


@dataclass(frozen=True)
class ClusterSpec:
    """One cluster to start and the workloads to run on it, in order."""

    name: str
    num_prefill: int
    num_decode: int
    caching: bool
    policy: str
    runs: tuple[tuple[str, str], ...]
    """(run name, workload) pairs."""
    auto: bool = False   # conditional disaggregation (serving mode auto, AUTO_THRESHOLD)
    warmup: bool = True  # the router's prefix-cache warm-ups of prefill workers

    def launcher_config(self, num_blocks: int, log_dir: Path) -> LauncherConfig:
        return LauncherConfig(num_prefill=self.num_prefill, num_decode=self.num_decode, http_port=0,
                              registry_port=0, num_blocks=num_blocks, threads=1,
                              log_dir=str(log_dir / self.name), startup_timeout_s=240.0, grace_s=15.0,
                              worker_args=("--prefix-caching",) if self.caching else (),
                              router_args=("--policy", self.policy) + (() if self.warmup else ("--no-prefill-warmup",)),
                              serving_mode="auto" if self.auto else "disaggregated",
                              colocated_threshold_tokens=AUTO_THRESHOLD if self.auto else 0)


def plan(kv_policy: str = "kv") -> list[ClusterSpec]:
    """The clusters of the module docstring's table, in start order."""
    mt, sp = "multiturn", "shared-prefix"
    return [ClusterSpec("1p1d-off", 1, 1, False, "load", ((f"{mt}/1p1d/off", mt),)),
            ClusterSpec("1p1d-on", 1, 1, True, kv_policy, ((f"{mt}/1p1d/on", mt),)),
            ClusterSpec("1p1d-on-nowarm", 1, 1, True, kv_policy, ((f"{mt}/1p1d/on-nowarm", mt),), warmup=False),
            ClusterSpec("1p1d-off-auto", 1, 1, False, "load", ((f"{mt}/1p1d/off-auto", mt),), auto=True),
            ClusterSpec("1p1d-on-auto", 1, 1, True, kv_policy, ((f"{mt}/1p1d/on-auto", mt),), auto=True),
            ClusterSpec("2p2d-off", 2, 2, False, "load",
                        ((f"{mt}/2p2d/off", mt), (f"{sp}/2p2d/off", sp))),
            ClusterSpec("2p2d-on", 2, 2, True, kv_policy, ((f"{mt}/2p2d/on", mt),)),
            ClusterSpec("2p2d-off-auto", 2, 2, False, "load", ((f"{mt}/2p2d/off-auto", mt),), auto=True),
            ClusterSpec("2p2d-on-auto", 2, 2, True, kv_policy, ((f"{mt}/2p2d/on-auto", mt),), auto=True),
            ClusterSpec("2p2d-on-load", 2, 2, True, "load", ((f"{sp}/2p2d/load", sp),)),
            ClusterSpec("2p2d-on-kv", 2, 2, True, kv_policy, ((f"{sp}/2p2d/kv", sp),))]


# -- verdicts (pure) ----------------------------------------------------------------------------
def row(result: dict | None, label: str) -> dict | None:
    """The report row called ``label`` of a run's result (None if the run or row is missing)."""
    return next((r for r in (result or {}).get("rows", ()) if r["label"] == label), None)


def compare_outputs(a: dict, b: dict) -> dict:
    """How two runs' ``outputs`` (``"<conversation>/<turn>" -> text``) differ: the count of keys
    whose texts differ (a key missing on one side differs) and the first such, in key order."""
    keys = sorted(set(a) | set(b), key=lambda k: (int(k.rsplit("/", 1)[1]), k))
    diff = [k for k in keys if a.get(k) != b.get(k)]
    first = {"key": diff[0], "a": a.get(diff[0]), "b": b.get(diff[0])} if diff else None
    return {"compared": len(keys), "differing": len(diff), "first": first}


def _verdict(name: str, ok: bool | None, detail: str) -> dict:
    return {"criterion": name, "verdict": {True: "PASS", False: "FAIL", None: "n/a"}[ok], "detail": detail}


def multiturn_verdicts(topo: str, off: dict | None, on: dict | None) -> list[dict]:
    """TTFT ratio, KV bytes reduction and identical greedy answers, caching on vs off."""
    a, b = row(off, "turns >= 2"), row(on, "turns >= 2")
    if not (a and b):
        why = "a run is missing or failed"
        return [_verdict(f"{topo} {n}", None, why) for n in ("TTFT", "KV bytes", "outputs")]
    speedup = (a["ttft_p50_ms"] / b["ttft_p50_ms"]
               if a["ttft_p50_ms"] is not None and b["ttft_p50_ms"] else None)
    sent_off, sent_on = a["kv_bytes_sent_per_request"], b["kv_bytes_sent_per_request"]
    reduction = 1 - sent_on / sent_off if sent_off else None
    same = compare_outputs(off["outputs"], on["outputs"])
    first = same["first"]
    return [
        _verdict(f"{topo} TTFT p50 turns>=2 off/on >= {TTFT_TARGET:g}x",
                 None if speedup is None else speedup >= TTFT_TARGET,
                 f"off {cell(a['ttft_p50_ms'], '{:.0f}')} ms, on {cell(b['ttft_p50_ms'], '{:.0f}')} ms,"
                 f" ratio {cell(speedup, '{:.2f}')}x"),
        _verdict(f"{topo} KV bytes sent per turn>=2 request -{KV_REDUCTION_TARGET:.0%}",
                 None if reduction is None else reduction >= KV_REDUCTION_TARGET,
                 f"off {cell(sent_off, '{:,.0f}')} B, on {cell(sent_on, '{:,.0f}')} B, "
                 f"reduction {cell(reduction, '{:.1%}')}"),
        _verdict(f"{topo} greedy outputs identical on vs off", same["differing"] == 0,
                 f"{same['differing']} of {same['compared']} (conversation/turn) differ"
                 + (f"; first {first['key']}: off {first['a']!r} / on {first['b']!r}" if first else "")),
    ]


def shared_prefix_verdict(load: dict | None, kv: dict | None) -> dict:
    """kv against load with caching on: prefill hit rate not lower and TTFT p50 not higher."""
    a, b = row(load, "all"), row(kv, "all")
    if not (a and b) or None in (a["prefill_hit_rate"], b["prefill_hit_rate"],
                                 a["ttft_p50_ms"], b["ttft_p50_ms"]):
        return _verdict("shared-prefix kv vs load", None, "a run is missing, failed or measured nothing")
    ok = b["prefill_hit_rate"] >= a["prefill_hit_rate"] and b["ttft_p50_ms"] <= a["ttft_p50_ms"]
    return _verdict("shared-prefix kv vs load: hit rate >=, TTFT p50 <=", ok,
                    f"hit rate load {a['prefill_hit_rate']:.1%} / kv {b['prefill_hit_rate']:.1%}, "
                    f"decode hit load {cell(a['decode_hit_rate'], '{:.1%}')} / kv "
                    f"{cell(b['decode_hit_rate'], '{:.1%}')}, TTFT p50 load "
                    f"{a['ttft_p50_ms']:.0f} ms / kv {b['ttft_p50_ms']:.0f} ms")


def verdicts(results: dict[str, dict]) -> list[dict]:
    """Every verdict of the module docstring from the runs' results (by run name)."""
    out = []
    for topo in ("1p1d", "2p2d"):
        extra = (("off", "on-nowarm"),) if topo == "1p1d" else ()
        for off, on in (("off", "on"), *extra, ("off", "on-auto"), ("off-auto", "on-auto")):
            out += multiturn_verdicts(f"{topo} {off} -> {on}", results.get(f"multiturn/{topo}/{off}"),
                                      results.get(f"multiturn/{topo}/{on}"))
    out.append(shared_prefix_verdict(results.get("shared-prefix/2p2d/load"),
                                     results.get("shared-prefix/2p2d/kv")))
    return out


def side_by_side(results: dict[str, dict], label_of: dict[str, str]) -> list[str]:
    """One row per run (the run name, then its row ``label_of[workload]``) in a single table."""
    rows = []
    for name, result in results.items():
        r = row(result, label_of[result["workload"]])
        if r:
            rows.append({**r, "label": name})
    return table_lines(rows)


# -- the run ------------------------------------------------------------------------------------
def run_cluster(spec: ClusterSpec, items: dict, sizes: Sizes, args, out: dict[str, dict]) -> None:
    """Start ``spec``, run its workloads (each result into ``out`` under its run name as it
    completes), stop it. Raises `LoadTestError`."""
    config = spec.launcher_config(args.num_blocks, Path(args.out) / "logs")
    print(f"[{spec.name}] starting {spec.num_prefill}P+{spec.num_decode}D, caching "
          f"{'on' if spec.caching else 'off'}, --policy {spec.policy}"
          f"{', auto' if spec.auto else ''}", flush=True)
    cluster = Cluster(config)
    try:
        try:
            cluster.start()
        except Exception as exc:   # a cluster that does not start is recorded; the others run
            raise LoadTestError(f"cluster {spec.name} did not start: {exc}") from exc
        url = cluster.url
        for run_name, workload in spec.runs:
            t0 = time.monotonic()
            out[run_name] = asyncio.run(run_workload(
                url, workload, items[workload], model=MODEL, max_tokens=sizes.max_tokens,
                concurrency=sizes.concurrency, warmup=spec.num_prefill * 2, seed=args.seed))
            print("\n".join(table_lines(out[run_name]["rows"], f"--- {run_name} "
                                        f"({time.monotonic() - t0:.0f} s)")), flush=True)
    finally:
        cluster.stop()


def build_parser() -> argparse.ArgumentParser:
    p = arg_parser("bench.prefix", __doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results/prefix-bench", help="directory for JSON and logs")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool blocks per worker")
    p.add_argument("--kv-policy", default="kv", help="router policy of the 'kv' runs")
    p.add_argument("--clusters", help="comma-separated subset of: " + ",".join(s.name for s in plan()))
    p.add_argument("--conversations", type=int, default=0,
                   help="multi-turn conversations (0: the default size's; more make the p50 steadier)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.conversations < 0:
        print("error: --conversations must be >= 0", file=sys.stderr)
        return 2
    if args.conversations:
        sizes = replace(sizes, conversations=args.conversations)
    specs = plan(args.kv_policy)
    if args.clusters:
        chosen = {c.strip() for c in args.clusters.split(",") if c.strip()}
        if chosen - {s.name for s in specs}:
            print(f"error: unknown clusters {sorted(chosen - {s.name for s in specs})}", file=sys.stderr)
            return 2
        specs = [s for s in specs if s.name in chosen]
    records = load_records()
    items = {"multiturn": build_conversations(records, sizes.conversations, sizes.turns, args.seed,
                                              sizes.user_tokens),
             "shared-prefix": build_shared_prefix(records, sizes.groups, sizes.users_per_group,
                                                  sizes.system_tokens, args.seed, sizes.question_tokens)}
    results, failures = {}, {}
    for spec in specs:
        try:
            run_cluster(spec, items, sizes, args, results)
        except LoadTestError as exc:
            failures[spec.name] = str(exc)
            print(f"[{spec.name}] FAILED: {str(exc)[-2000:]}", file=sys.stderr, flush=True)
    labels = {"multiturn": "turns >= 2", "shared-prefix": "all"}
    lines = ["=== turns >= 2 (multiturn) / all (shared-prefix), per run ==="]
    lines += side_by_side(results, labels) + ["=== verdicts ==="]
    checks = verdicts(results)
    lines += [f"{v['verdict']:<5} {v['criterion']}: {v['detail']}" for v in checks]
    lines += [f"FAILED cluster {name} (its output: above and in the JSON's failures)"
              for name in failures]
    print("\n".join(lines))
    record = {"sizes": asdict(sizes), "seed": args.seed, "num_blocks": args.num_blocks,
              "clusters": [asdict(s) for s in specs], "verdicts": checks, "failures": failures,
              "table": lines, "runs": results}
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = write_json(Path(args.out) / f"prefix-bench-{stamp}.json", record, args)
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
