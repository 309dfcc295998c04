"""The prefill scheduler's measurements: tokens/s by pass size, and a burst's TTFT by policy.

    python -m bench.prefill [--threads 1] [--weights fp32] [--quick] [--json PATH]

Two tables, real forward passes of the default model on this machine, one run:

1. **Pass size**: one prompt of 16 .. 1024 tokens per pass, tokens/s (median of repetitions).
   Where tokens/s stops rising is the knee `engine.scheduling` batches up to
   (``--prefill-batch-tokens``; a CPU worker times its own at start-up: `engine.prefill_knee`).
2. **A burst**: prompts that queue together (new tokens after a cached prefix, the shape of
   multi-turn chat with prefix caching), each policy's passes run for real, every prompt's TTFT
   = the end of the pass holding its last chunk: ``fifo-one-pass`` (arrival order, everything
   up to ``max_num_batched_tokens`` in one pass: the worker before the scheduler),
   ``fifo-one-at-a-time``, and ``scheduler`` (`by_response_ratio` + `PassBudget`, what the
   worker does).
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import arg_parser, median_time, write_json
from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.kv_cache import KVPool, blocks_needed
from engine.loader import load_model
from engine.scheduling import PassBudget, by_response_ratio, default_batch_tokens

BS = 16


def _pass(loaded, pool, chunks: list[SeqChunk]) -> float:
    t0 = time.perf_counter()
    loaded.model.forward(ForwardBatch.build(chunks, BS), pool)
    return time.perf_counter() - t0


def pass_sizes(loaded, sizes, reps: int) -> list[dict]:
    """Tokens/s of one prompt of each size alone in a pass (median of ``reps`` after a warm-up)."""
    pool = KVPool(loaded.config, CacheConfig(num_blocks=blocks_needed(max(sizes), BS) + 1, dtype=loaded.kv_dtype))
    rows = []
    for n in sizes:
        blocks = pool.allocator.allocate(blocks_needed(n, BS))
        chunk = SeqChunk(torch.randint(100, 40000, (n,)).tolist(), 0, blocks)
        t = median_time(lambda: _pass(loaded, pool, [chunk]), reps)
        pool.allocator.free(blocks)
        rows.append({"tokens": n, "pass_ms": t * 1e3, "tokens_per_s": n / t})
    return rows


def burst(loaded, news: list[int], cached: int, max_tokens: int, batch_tokens: int) -> dict:
    """Each policy's TTFTs (seconds from the burst) for prompts of ``news`` new tokens after
    ``cached`` cached ones, all queued at time 0."""
    total = [cached + n for n in news]
    pool = KVPool(loaded.config, CacheConfig(num_blocks=sum(blocks_needed(t, BS) for t in total) + 1,
                                             dtype=loaded.kv_dtype))
    tables = [pool.allocator.allocate(blocks_needed(t, BS)) for t in total]
    ids = [torch.randint(100, 40000, (t,)).tolist() for t in total]
    for i in range(len(news)):   # the cached prefixes, computed once (not timed)
        loaded.model.forward(ForwardBatch.build([SeqChunk(ids[i][:cached], 0, tables[i])], BS), pool)

    def run(plan_next) -> list[float]:
        done = [cached] * len(news)
        ttft = [0.0] * len(news)
        clock = 0.0
        while any(d < t for d, t in zip(done, total)):
            plan = plan_next(done, clock)
            clock += _pass(loaded, pool, [SeqChunk(ids[i][done[i]:done[i] + n], done[i], tables[i])
                                          for i, n in plan])
            for i, n in plan:
                done[i] += n
                if done[i] == total[i]:
                    ttft[i] = clock
        return ttft

    def policy(order, cap_first: int, cap_rest: int):
        """Passes as the worker builds them: prompts in ``order``, each pass a fresh `PassBudget`."""
        def plan_next(done, clock):
            budget, plan = PassBudget(cap_first, cap_rest), []
            for i in order([i for i in range(len(news)) if done[i] < total[i]], clock, done):
                n = budget.take(total[i] - done[i])
                if n:
                    plan.append((i, n))
                if done[i] + n < total[i]:
                    break
            return plan
        return plan_next

    def fifo(waiting, clock, done):
        return waiting

    def hrrn(waiting, clock, done):   # all queued 1 ms before the first pass; the rate scales the ratios
        return by_response_ratio(waiting, clock + 1e-3, 600.0, lambda i: 0.0, lambda i: total[i] - done[i])

    out = {}
    for name, plan_next in (("fifo-one-pass", policy(fifo, max_tokens, max_tokens)),
                            ("fifo-one-at-a-time", policy(fifo, max_tokens, 1)),
                            ("scheduler", policy(hrrn, max_tokens, batch_tokens))):
        run(plan_next)   # warm-up
        ttft = run(plan_next)
        out[name] = {"ttft_s": ttft, "mean_ms": statistics.mean(ttft) * 1e3,
                     "p50_ms": statistics.median(ttft) * 1e3, "last_ms": max(ttft) * 1e3}
    return out


def main(argv=None) -> dict:
    ap = arg_parser("bench.prefill", __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=0, help="the scheduler's knee (0: the untimed CPU default, 128)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(weights=args.weights)
    batch_tokens = args.batch_tokens or default_batch_tokens("cpu", args.max_num_batched_tokens)
    sizes = (16, 64, 128, 256, 512) if args.quick else (16, 32, 64, 128, 256, 512, 1024)
    rows = pass_sizes(loaded, sizes, 2 if args.quick else 5)
    print(f"threads={args.threads}  weights={args.weights}  cpu={torch.backends.cpu.get_cpu_capability()}")
    print(f"{'pass tokens':>11} {'ms':>8} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['tokens']:>11} {r['pass_ms']:>8.1f} {r['tokens_per_s']:>9.0f}")
    bursts = {"4 x 85 after 400 cached": ([85] * 4, 400),
              "mixed 30..350 after 256 cached": ([350, 60, 200, 30, 120, 90], 256)}
    result = {"threads": args.threads, "weights": args.weights, "batch_tokens": batch_tokens,
              "max_num_batched_tokens": args.max_num_batched_tokens, "pass_sizes": rows, "bursts": {}}
    print(f"\nburst TTFT (ms from the burst; --prefill-batch-tokens {batch_tokens})")
    print(f"{'burst':32} {'policy':20} {'mean':>7} {'p50':>7} {'last':>7}")
    for label, (news, cached) in bursts.items():
        res = burst(loaded, news, cached, args.max_num_batched_tokens, batch_tokens)
        result["bursts"][label] = res
        for name, r in res.items():
            print(f"{label:32} {name:20} {r['mean_ms']:>7.0f} {r['p50_ms']:>7.0f} {r['last_ms']:>7.0f}")
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
