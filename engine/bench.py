"""Engine throughput against Hugging Face transformers on the same weights and thread count.

    python -m engine.bench [--threads 1] [--quick] [--json PATH]

Measures, in one run and side by side:
- prefill tokens/s for one prompt of 128 / 512 / 2048 tokens (KV written to the pool / cache);
- decode tokens/s for a batch of 1 / 8 / 32 sequences (128-token prompts, 32 decode steps timed).
Transformers runs a plain ``model(...)`` loop with its KV cache (no ``generate`` overhead), so the
reference is as fast as transformers gets. Prints a table with the ratio ours / transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.generator import Generator
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.attention import ForwardBatch, SeqChunk
from engine.sampling import SamplingParams


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_prefill_ours(loaded, n: int, reps: int) -> float:
    pool = KVPool(loaded.config, CacheConfig(num_blocks=-(-n // 16) + 1))
    blocks = pool.allocator.allocate(-(-n // 16))
    ids = torch.randint(100, 40000, (n,)).tolist()
    batch = ForwardBatch.build([SeqChunk(ids, 0, blocks)], 16)
    return n / _median_time(lambda: loaded.model.forward(batch, pool), reps)


@torch.inference_mode()
def bench_prefill_hf(hf, n: int, reps: int) -> float:
    ids = torch.randint(100, 40000, (1, n))
    return n / _median_time(lambda: hf(ids, use_cache=True, logits_to_keep=1), reps)


def bench_decode_ours(loaded, batch: int, prompt_len: int, steps: int) -> float:
    blocks_per_seq = -(-(prompt_len + steps + 2) // 16)
    pool = KVPool(loaded.config, CacheConfig(num_blocks=batch * blocks_per_seq))
    gen = Generator(loaded.model, pool, None, SchedulerConfig(max_num_seqs=batch,
                                                              max_num_batched_tokens=prompt_len * batch))
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        gen.add_request(f"r{i}", torch.randint(100, 40000, (prompt_len,)).tolist(), params)
    while gen.waiting:
        gen.step()
    gen.step()  # warm-up decode step
    t0 = time.perf_counter()
    for _ in range(steps):
        gen.step()
    return batch * steps / (time.perf_counter() - t0)


@torch.inference_mode()
def bench_decode_hf(hf, batch: int, prompt_len: int, steps: int) -> float:
    ids = torch.randint(100, 40000, (batch, prompt_len))
    out = hf(ids, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    out = hf(token, past_key_values=past, use_cache=True)  # warm-up decode step
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * steps / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    loaded = load_model()
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                              dtype=torch.float32).eval()
    reps, steps = (2, 8) if args.quick else (5, 32)
    rows = []
    for n in (128, 512, 2048):
        ours, theirs = bench_prefill_ours(loaded, n, reps), bench_prefill_hf(hf, n, reps)
        rows.append({"phase": "prefill", "size": n, "pdserve_tok_s": ours, "transformers_tok_s": theirs})
    for b in (1, 8, 32):
        ours, theirs = bench_decode_ours(loaded, b, 128, steps), bench_decode_hf(hf, b, 128, steps)
        rows.append({"phase": "decode", "size": b, "pdserve_tok_s": ours, "transformers_tok_s": theirs})
    print(f"threads={args.threads}  model={loaded.config.name}  dtype=float32")
    print(f"{'phase':8} {'size':>6} {'pdserve tok/s':>14} {'transformers tok/s':>19} {'ratio':>7}")
    for r in rows:
        r["ratio"] = r["pdserve_tok_s"] / r["transformers_tok_s"]
        label = "tokens" if r["phase"] == "prefill" else "batch"
        print(f"{r['phase']:8} {r['size']:>6} {r['pdserve_tok_s']:>14.1f} {r['transformers_tok_s']:>19.1f} "
              f"{r['ratio']:>6.2f}x  ({label})")
    result = {"threads": args.threads, "quick": args.quick, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
