"""Start-up time of ``pdserve up``: eager against compiled attention kernels, inductor's cache warm.

    python -m bench.startup [--rounds 3] [--cpus 0,1] [--up-args "..."] [--cold] [--json PATH]

Each round starts ``pdserve up`` on free ports (every worker pinned, ``--cpu-affinity``), times it
from launch to its "pdserve is up" line (every worker registered and ready), and stops it
(SIGINT) before the next starts. Configurations, alternating round by round:

- ``eager``: ``--attention-backend grouped``: nothing is compiled (no dynamo, no inductor);
- ``compiled``: the defaults (``--attention-backend auto``): each worker builds its compiled
  attention kernels (`worker.kernels.warm_kernel_alone`) before it registers, loading the
  AOTInductor packages kept on disk (`engine.aot_kernel`; one untimed ``compiled`` start first
  builds any missing, unless ``--no-prime``).

``--cold`` adds one ``compiled`` start with an empty cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``,
where the packages live): what the first start on a machine costs.

Prints one row per start (seconds to "pdserve is up", and the kernel build seconds each worker
logged), the medians and the ratio compiled / eager; writes them to ``--json``. The engine issue's
bar: a restart with a warm cache is ready within 1.5x the eager start-up.
"""

from __future__ import annotations

import os
import re
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import arg_parser, write_json
from loadtest.compare import Server, _pdserve_command

BUILT = re.compile(r"(prompt attention|decode attention|layer operators): compiled .* ready in ([0-9.]+) s")
CONFIGS = {"eager": ("--attention-backend", "grouped"), "compiled": ()}


def kernel_builds(log_dir: Path) -> dict[str, float]:
    """``{"<worker log stem>/<kernel>": seconds}`` from the workers' "ready in" lines under
    ``log_dir`` (`worker.kernels.set_attention_kernels` logs one per kernel, and the prompt
    kernel one more where its package is built to be timed first: summed)."""
    out: dict[str, float] = {}
    for path in sorted(log_dir.glob("*.log")):
        for match in BUILT.finditer(path.read_text(errors="replace")):
            key = f"{path.stem}/{match.group(1)}"
            out[key] = out.get(key, 0.0) + float(match.group(2))
    return out


def start_once(pdserve: list[str], args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Start ``pdserve up <args>`` once, time it to "pdserve is up", stop it; returns
    ``{"seconds", "kernels"}`` (`kernel_builds`). ``env`` entries are set for the start only.
    Raises loadtest.errors.LoadTestError when it does not come up within ``timeout_s``."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-startup-") as logs:
            server = Server(pdserve, [*args, "--log-dir", logs], timeout_s)
            t0 = time.monotonic()
            with server:
                seconds = time.monotonic() - t0
            return {"seconds": round(seconds, 2), "kernels": kernel_builds(Path(logs))}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summary(rows: list[dict]) -> dict:
    """Median seconds per configuration (cold starts apart) and ``ratio``: compiled / eager."""
    med = {name: statistics.median([r["seconds"] for r in rows if r["config"] == name])
           for name in CONFIGS if any(r["config"] == name for r in rows)}
    out = {f"median_{k}_s": round(v, 2) for k, v in med.items()}
    if len(med) == 2:
        out["ratio"] = round(med["compiled"] / med["eager"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = arg_parser("bench.startup", __doc__)
    p.add_argument("--rounds", type=int, default=3, help="timed starts per configuration")
    p.add_argument("--cpus", default="0,1", help="--cpu-affinity for the workers")
    p.add_argument("--up-args", default="", help="extra `pdserve up` flags for every start")
    p.add_argument("--pdserve", help="command that runs pdserve (default: pdserve next to python)")
    p.add_argument("--cold", action="store_true", help="add one compiled start with an empty inductor cache")
    p.add_argument("--no-prime", action="store_true", help="skip the untimed compiled start first")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="per start, s")
    p.add_argument("--json", default="bench/results/startup.json")
    args = p.parse_args(argv)
    pdserve = _pdserve_command(args.pdserve)
    base = ["--cpu-affinity", args.cpus, *shlex.split(args.up_args)]
    rows = []
    if args.cold:
        with tempfile.TemporaryDirectory(prefix="pdserve-inductor-") as cache:
            row = start_once(pdserve, base, args.startup_timeout, {"TORCHINDUCTOR_CACHE_DIR": cache})
        rows.append({"config": "compiled, cold cache", "round": 0, **row})
    if not args.no_prime:
        start_once(pdserve, base, args.startup_timeout)
    for i in range(1, args.rounds + 1):
        for name, flags in CONFIGS.items():
            rows.append({"config": name, "round": i,
                         **start_once(pdserve, [*base, *flags], args.startup_timeout)})
            print(f"{name:<22} round {i}: {rows[-1]['seconds']:6.2f} s  kernels {rows[-1]['kernels']}",
                  flush=True)
    result = {"starts": rows, **summary(rows)}
    print("\n| start | round | seconds to up | kernel builds (s) |\n|---|---|---|---|")
    for r in rows:
        kernels = ", ".join(f"{k} {v:.1f}" for k, v in r["kernels"].items()) or "-"
        print(f"| {r['config']} | {r['round']} | {r['seconds']:.2f} | {kernels} |")
    print("\n" + "  ".join(f"{k} {v}" for k, v in summary(rows).items()))
    write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
