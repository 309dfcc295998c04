"""Resident memory of oneDNN matmuls over many row counts: the prefill worker's growth in miniature.

A prefill pass multiplies ``[rows, in]`` activations by the model's packed weights
(``torch.ops.mkldnn._linear_pointwise``, `engine.linear`), and ``rows`` differs from one pass to the
next. Each configuration runs in a fresh process (the settings must precede oneDNN's first use):
SmolLM2-135M's four projection shapes at ``--steps`` row counts (``(37 k) mod 1500 + 1``, or 300
every time for ``same``), reading VmRSS six times, each followed by ``malloc_trim(0)`` and a second
read (what the heap held free). Configurations:

    same        one row count (300), defaults
    distinct    many row counts, defaults
    caches      many row counts, oneDNN's and ideep's caches at 64 entries
    mmap        many row counts, glibc's mmap threshold fixed at 1 MiB, 2 arenas
    both        caches + mmap: what `worker.runtime.bound_native_memory` gives a prefill worker

Measured: docs/PERFORMANCE.md, "Memory over a long run".
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

from bench.common import arg_parser, write_json

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))   # (out, in): q/o, k/v, gate/up, down
CONFIGS = {"same": (False, False, True), "distinct": (False, False, False),
           "caches": (True, False, False), "mmap": (False, True, False), "both": (True, True, False)}


def _rss_mb() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


def child(config: str, steps: int) -> dict:
    """One configuration, in this process (call it in a fresh one)."""
    caches, mmap, same = CONFIGS[config]
    libc = ctypes.CDLL("libc.so.6")
    if mmap:
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD
        libc.mallopt(-8, 2)         # M_ARENA_MAX
    if caches:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["LRU_CACHE_CAPACITY"] = "64"
    import torch

    torch.set_num_threads(1)
    dt = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i).to(dt), None) for o, i in SHAPES]
    start, reads = _rss_mb(), []
    for k in range(steps):
        rows = 300 if same else (37 * k) % 1500 + 1
        for w, (_, i) in zip(weights, SHAPES):
            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, i).to(dt), w, None, "none", [], "")
        if (k + 1) % max(1, steps // 6) == 0:
            before = _rss_mb()
            libc.malloc_trim(0)
            reads.append({"step": k + 1, "rss_mb": round(before), "trimmed_mb": round(_rss_mb())})
    return {"config": config, "dtype": str(dt), "start_mb": round(start), "reads": reads}


def main(argv=None) -> dict:
    ap = arg_parser("bench.shapes_memory", __doc__)
    ap.add_argument("--steps", type=int, default=1200, help="row counts per configuration")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--child", help="run one configuration in this process (internal)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return {}
    result = {"steps": args.steps, "runs": []}
    print(f"{'config':10} {'start':>6}  RSS MB / after malloc_trim, six times over {args.steps} steps")
    for config in args.configs.split(","):
        out = subprocess.run([sys.executable, "-m", "bench.shapes_memory", "--child", config,
                              "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        result["runs"].append(run)
        print(f"{config:10} {run['start_mb']:>6}  " + "  ".join(f"{r['rss_mb']}/{r['trimmed_mb']}"
                                                           for r in run["reads"]), flush=True)
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
