"""The sampler's cost a step: sampled rows drawn together against one at a time.

    python -m bench.sampling [--threads 1] [--reps 30] [--rows 1,2,4,8,32,128] [--vocab 49152]
                             [--temperature 0.8] [--json PATH]

Per row count, float32 logits ``[rows, vocab]`` (normal, scale 3, seeded; the cost does not
depend on their values) and rows of plain temperature sampling, each with its own generator as a
request has (`engine.sampling.SamplingParams.make_generator`), median milliseconds of:

- ``sample``: `engine.sampling.sample` as a step calls it (the rows' draws together,
  `engine.draw.draw_rows`, from `engine.draw.DRAW_ROWS_MIN` rows on);
- ``one at a time``: the sampler before that (`one_at_a_time`): one ``max`` with indices over the
  batch (the validity check), then each row's own draw (`engine.sampling._sample_row`: the row's
  softmax, its whole running sum and a search);
- ``greedy``: `sample` on greedy rows (one ``max`` over the logits), the floor of any step.

The three are called in turn, alternating. Prints a table and, with ``--json``, writes it.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import arg_parser, write_json
from engine.sampling import Row, SamplingParams, _sample_row, sample


def one_at_a_time(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """The sampler before rows were drawn together: the validity pass (``max`` with indices over
    the batch, `engine.sampling.sample`'s), then each row's own draw."""
    best, _ = logits.max(dim=-1)
    torch.isfinite(best).tolist()
    return [_sample_row(logits[r], row) for r, row in enumerate(rows)]


def bench_sampling(rows: tuple[int, ...], vocab: int, temperature: float, reps: int) -> list[dict]:
    """``[{"rows", "sample_ms", "one_at_a_time_ms", "greedy_ms"}, ...]`` (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in rows:
        logits = torch.randn(n, vocab, generator=gen) * 3
        params = SamplingParams(temperature=temperature)
        sampled = [Row(params, params.make_generator(), [1, 2, 3]) for _ in range(n)]
        greedy = [Row(SamplingParams(temperature=0.0), None, [1, 2, 3]) for _ in range(n)]
        calls = {"sample": lambda: sample(logits, sampled),
                 "one_at_a_time": lambda: one_at_a_time(logits, sampled),
                 "greedy": lambda: sample(logits, greedy)}
        spent: dict[str, list[float]] = {name: [] for name in calls}
        for rep in range(reps + 1):
            names = list(calls) if rep % 2 else list(reversed(calls))
            for name in names:
                start = time.perf_counter()
                calls[name]()
                if rep:   # the first of each is a warm-up
                    spent[name].append((time.perf_counter() - start) * 1e3)
        out.append({"rows": n, **{f"{name}_ms": statistics.median(t) for name, t in spent.items()}})
    return out


def main(argv=None) -> dict:
    ap = arg_parser("bench.sampling", __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="1,2,4,8,32,128")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = bench_sampling(tuple(int(r) for r in args.rows.split(",")), args.vocab, args.temperature, args.reps)
    print(f"threads={args.threads}  vocab={args.vocab}  temperature={args.temperature}  (ms a step)")
    print(f"{'rows':>5} {'sample':>9} {'one at a time':>14} {'greedy':>9}")
    for r in rows:
        print(f"{r['rows']:>5} {r['sample_ms']:>9.3f} {r['one_at_a_time_ms']:>14.3f} {r['greedy_ms']:>9.3f}")
    result = {"threads": args.threads, "vocab": args.vocab, "temperature": args.temperature, "rows": rows}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
