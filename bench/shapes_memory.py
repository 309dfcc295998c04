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
    both        caches + mmap
    worker      caches + 2 arenas: what `worker.runtime.bound_native_memory` gives a prefill worker

``--prefill-speed`` times the same configurations on the real model instead (the default
SmolLM2-135M, ``--weights native``, one thread, each in a fresh process): ``--passes`` prefill
passes of 1-8 prompts of 128-384 random tokens each (seeded), after 3 warm-up passes, and prints
prompt tokens per second: what a setting costs the prefill worker.

Measured: docs/PERFORMANCE.md, "Memory over a long run".
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

from bench.common import arg_parser, write_json

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))   # (out, in): q/o, k/v, gate/up, down
CONFIGS = {"same": (False, False, True), "distinct": (False, False, False),
           "caches": (True, False, False), "mmap": (False, True, False), "both": (True, True, False),
           "worker": (True, False, False)}


def _rss_mb() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


def _configure(config: str) -> ctypes.CDLL:
    """Apply ``config``'s settings to this process (before torch is imported)."""
    caches, mmap, _ = CONFIGS[config]
    libc = ctypes.CDLL("libc.so.6")
    if mmap:
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD
    if mmap or config == "worker":
        libc.mallopt(-8, 2)         # M_ARENA_MAX
    if caches:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["LRU_CACHE_CAPACITY"] = "64"
    return libc


def child(config: str, steps: int) -> dict:
    """One configuration, in this process (call it in a fresh one)."""
    same = CONFIGS[config][2]
    libc = _configure(config)
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


def speed_child(config: str, passes: int, seed: int) -> dict:
    """Prefill tokens/s of the real model under ``config``, in this process (a fresh one)."""
    import random

    _configure(config)
    import torch

    from engine.attention import ForwardBatch, SeqChunk
    from engine.config import CacheConfig
    from engine.kv_cache import KVPool
    from engine.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model(None, weights="native")
    pool = KVPool(loaded.config, CacheConfig(num_blocks=8 * 24 + 1, dtype=loaded.kv_dtype))
    rng = random.Random(seed)

    def one_pass() -> int:
        chunks, first = [], 0
        for _ in range(rng.randint(1, 8)):
            n = rng.randint(128, 384)
            blocks = -(-n // 16)
            chunks.append(SeqChunk([rng.randint(100, 40000) for _ in range(n)], 0,
                                   list(range(first, first + blocks))))
            first += blocks
        batch = ForwardBatch.build(chunks, 16)
        loaded.model.forward(batch, pool)
        return batch.input_ids.shape[0]

    for _ in range(3):
        one_pass()
    t0, tokens = time.perf_counter(), 0
    for _ in range(passes):
        tokens += one_pass()
    seconds = time.perf_counter() - t0
    return {"config": config, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def main(argv=None) -> dict:
    ap = arg_parser("bench.shapes_memory", __doc__)
    ap.add_argument("--steps", type=int, default=1200, help="row counts per configuration")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--prefill-speed", action="store_true",
                    help="time prefill passes of the real model under each configuration")
    ap.add_argument("--passes", type=int, default=60, help="timed passes per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help="run one configuration in this process (internal)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.child:
        out = (speed_child(args.child, args.passes, args.seed) if args.prefill_speed
               else child(args.child, args.steps))
        print(json.dumps(out))
        return {}
    if args.prefill_speed:
        return _speed_main(args)
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


def _speed_main(args) -> dict:
    result = {"passes": args.passes, "seed": args.seed, "runs": []}
    print(f"{'config':10} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    for config in args.configs.split(","):
        out = subprocess.run([sys.executable, "-m", "bench.shapes_memory", "--prefill-speed", "--child",
                              config, "--passes", str(args.passes), "--seed", str(args.seed)],
                             capture_output=True, text=True, check=True)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        result["runs"].append(run)
        print(f"{config:10} {run['tokens']:>7} {run['seconds']:>8} {run['tokens_per_s']:>8}", flush=True)
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
