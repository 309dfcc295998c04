"""What logprobs, structured outputs and penalties cost per token, beside plain decoding, in one run.

    python -m bench.features [--weights native] [--batch 8] [--steps 48] [--json PATH]

A batch of ``--batch`` sequences (128-token prompts) decodes ``--steps`` steps in each mode; the
modes run in turn, twice (ABAB order), and each reports the median step time over both rounds:

- ``plain``: greedy, nothing else (the reference);
- ``logprobs``: every row asks for logprobs with the 5 best;
- ``json``: every row under a JSON schema (an array of at least 500 integers: it cannot end
  inside the timed steps, so every step masks every row);
- ``regex``: every row under a regex (``[a-z ]{2000,}``);
- ``penalties``: presence + frequency + repetition penalties on every row;
- ``mixed-json``: half the rows under the JSON schema, half plain.

Per-token cost = (mode's step time - plain's) / rows using the feature. ``mixed-json`` shows what
plain rows pay when batch-mates use a grammar: the step is shared, so the extra time is the
grammar rows' own masking, nothing per plain row. One thread (``--threads``); prints a table and
writes JSON.
"""

from __future__ import annotations

import statistics

import torch

from bench.common import arg_parser, median_time, write_json
from engine.config import CacheConfig, SchedulerConfig
from engine.generator import Generator
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.sampling import SamplingParams

PROMPT_LEN = 128


def _modes(grammars: dict[str, str]) -> dict[str, callable]:
    plain = dict(temperature=0, ignore_eos=True)
    return {
        "plain": lambda i: SamplingParams(**plain),
        "logprobs": lambda i: SamplingParams(**plain, logprobs=5),
        "json": lambda i: SamplingParams(**plain, grammar=grammars["json"]),
        "regex": lambda i: SamplingParams(**plain, grammar=grammars["regex"]),
        "penalties": lambda i: SamplingParams(**plain, presence_penalty=0.5, frequency_penalty=0.5,
                                              repetition_penalty=1.1),
        "mixed-json": lambda i: SamplingParams(**plain, grammar=grammars["json"] if i % 2 else ""),
    }


def _grammars() -> dict[str, str]:
    import llguidance

    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
    return {"json": llguidance.LLMatcher.grammar_from_json_schema(schema),
            "regex": llguidance.LLMatcher.grammar_from_regex("[a-z ]{2000,}")}


def step_time(loaded, make_params, batch: int, steps: int, seed: int = 0) -> float:
    """Median seconds of one decode step of ``batch`` sequences built by ``make_params(i)``."""
    blocks = -(-(PROMPT_LEN + steps + 4) // 16)
    pool = KVPool(loaded.config, CacheConfig(num_blocks=batch * blocks, dtype=loaded.kv_dtype))
    gen = Generator(loaded.model, pool, loaded.tokenizer,
                    SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=PROMPT_LEN * batch))
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        p = make_params(i)
        gen.add_request(f"r{i}", torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist(),
                        SamplingParams(**{**p.__dict__, "max_tokens": steps + 4}))
    while gen.waiting:
        gen.step()
    steps_out = []
    t = median_time(lambda: steps_out.append(gen.step()), steps)   # after one warm-up decode step
    if any(len(outs) != batch or any(o.finished for o in outs) for outs in steps_out):
        raise RuntimeError("a sequence finished inside the timed steps: the comparison would be off")
    return t


def main(argv: list[str] | None = None) -> dict:
    ap = arg_parser("bench.features", __doc__)
    ap.add_argument("--weights", default="native", help="weights mode (engine.config.WEIGHT_MODES)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="bench_features.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(weights=args.weights)
    modes = _modes(_grammars())
    samples: dict[str, list[float]] = {name: [] for name in modes}
    with torch.inference_mode():
        for _round in range(2):
            for name, make in modes.items():
                samples[name].append(step_time(loaded, make, args.batch, args.steps))
    base = statistics.median(samples["plain"])
    users = {"plain": 0, "mixed-json": args.batch // 2}
    rows = []
    print(f"weights {args.weights}, batch {args.batch}, {args.steps} decode steps x 2 rounds, "
          f"{args.threads} thread(s)")
    print(f"{'mode':12} {'step ms':>8} {'tok/s':>8} {'vs plain':>9} {'extra us/token':>15}")
    for name, times in samples.items():
        t = statistics.median(times)
        n = users.get(name, args.batch)
        extra = (t - base) / n * 1e6 if n else 0.0
        rows.append({"mode": name, "step_ms": t * 1e3, "tokens_per_s": args.batch / t, "vs_plain": t / base,
                     "extra_us_per_feature_token": extra, "rounds_ms": [x * 1e3 for x in times]})
        print(f"{name:12} {t * 1e3:8.2f} {args.batch / t:8.1f} {t / base:8.3f}x {extra:15.1f}")
    result = {"weights": args.weights, "batch": args.batch, "steps": args.steps, "threads": args.threads,
              "rows": rows}
    print(f"wrote {write_json(args.json, result, args)}")
    return result


if __name__ == "__main__":
    main()
