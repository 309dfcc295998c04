"""Native mode's LM head at few rows: the Q8_0 blocks on MatMulNBits against the dense copy.

    python -m bench.head [--threads 1] [--reps 15] [--rows 1,2,4,6,8,12,16] [--json PATH]

The head of the default GGUF (`engine.quant.HeadLinear`: 49152 x 576 for SmolLM2-135M), fed the
model's own final-normed hidden states (the last token of chat prompts, captured from a prompt
pass, repeated to fill the larger row counts) rather than random rows: how many logits
``low_bit`` recomputes exactly depends on how far the best one stands from the rest. Per row
count, median milliseconds of ``low_bit`` (int8 activations on MatMulNBits, the candidates for
the largest logit recomputed in float32) and ``dense`` (the dense copy, `engine.quant.dense_dtype`),
the two called in turn, and whether every row's largest logit is the same token through both.
The model's own ``max_int8_rows`` (`engine.quant.default_int8_head_rows`) is printed beside them.
Prints a table and, with ``--json``, writes it.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import arg_parser, write_json
from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.quant import dense_dtype

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis.",
           "List ten animals.", "Who wrote Hamlet?", "Tell me a joke.", "What is 12 + 30?",
           "Describe a baker from Paris as a JSON object."]


def hidden_states(loaded) -> torch.Tensor:
    """``[len(PROMPTS), hidden]``: the rows the head is given at the end of each chat prompt's pass."""
    model, tok = loaded.model, loaded.tokenizer
    pool = KVPool(loaded.config, CacheConfig(block_size=16, num_blocks=64, dtype=loaded.kv_dtype))
    chunks = []
    for p in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        chunks.append(SeqChunk(ids, 0, pool.allocator.allocate(-(-len(ids) // 16))))
    head, seen = model._lm_head, []
    model._lm_head = lambda x: seen.append(x.clone()) or head(x)
    try:
        with torch.inference_mode():
            model.forward(ForwardBatch.build(chunks, 16), pool)
    finally:
        model._lm_head = head
    return seen[-1]


def bench_head(loaded, rows: tuple[int, ...], reps: int) -> list[dict]:
    """Per row count: ``low_bit_ms``, ``dense_ms`` (medians of ``reps`` calls each, in turn) and
    ``same_argmax``."""
    head, states = loaded.model._lm_head, hidden_states(loaded)
    out = []
    for m in rows:
        x = states.repeat(-(-m // len(states)), 1)[:m].contiguous()
        spent = {"low_bit": [], "dense": []}
        with torch.inference_mode():
            for rep in range(reps + 1):
                for name in ("low_bit", "dense") if rep % 2 else ("dense", "low_bit"):
                    start = time.perf_counter()
                    getattr(head, name)(x)
                    if rep:   # the first of each is a warm-up
                        spent[name].append((time.perf_counter() - start) * 1e3)
            same = torch.equal(head.low_bit(x).argmax(-1), head.dense(x).float().argmax(-1))
        out.append({"rows": m, "low_bit_ms": statistics.median(spent["low_bit"]),
                    "dense_ms": statistics.median(spent["dense"]), "same_argmax": same})
    return out


def main(argv=None) -> dict:
    ap = arg_parser("bench.head", __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,4,6,8,12,16")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(weights="native")
    rows = bench_head(loaded, tuple(int(r) for r in args.rows.split(",")), args.reps)
    dense = str(dense_dtype()).removeprefix("torch.")
    print(f"threads={args.threads}  cpu={torch.backends.cpu.get_cpu_capability()}  dense copy {dense}, the model's "
          f"int8 head up to {loaded.model._lm_head.max_int8_rows} rows")
    print(f"{'rows':>5} {'int8 ms':>9} {'dense ms':>9} {'same argmax':>12}")
    for r in rows:
        print(f"{r['rows']:>5} {r['low_bit_ms']:>9.2f} {r['dense_ms']:>9.2f} {str(r['same_argmax']):>12}")
    result = {"threads": args.threads, "dense_dtype": dense, "max_int8_rows": loaded.model._lm_head.max_int8_rows,
              "rows": rows}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
