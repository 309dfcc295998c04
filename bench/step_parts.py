"""Where a forward pass's time goes: each part of the default model's decode steps (and a prompt
chunk), timed inside the pass, on the kernels a CPU worker runs.

    python -m bench.step_parts [--weights native] [--threads 1] [--rows 1,8,32] [--context 256]
                               [--attention-backend auto|grouped] [--linear-backend auto] [--reps 10]
                               [--json PATH]

For each pass kind (decode steps of ``--rows`` one-token sequences over ``--context``-token
contexts, and one prompt chunk of ``--context`` tokens), ``--reps`` passes are run through a
`ModelRunner` after a warm-up, with each part of the pass wrapped in a `time.perf_counter` timer
(`PartTimers`): every projection kind of the layers (``wqkv``, ``wo``, ``w_gate_up``,
``w_down``, their kernels as built: `engine.linear.Linear`, `engine.quant.Int4Linear`), the LM
head, attention (`engine.attention.paged_attention`: the decode kernel or the grouped path, the
prompt kernel or SDPA), the KV writes (`engine.attention.store_kv`), the fused operators between
the matmuls (`engine.glue.CompiledGlue`'s ``rope_split``, ``add_norm``, ``silu_mul``) or their eager
RMSNorm (``rms_norm``). ``rest`` is the pass's wall time less the parts: the embedding, the
Python between the operators, the eager operators not listed, the sampling logits' copy.

The table gives ms per pass and each part's share of it; the JSON (``--json``) the same per pass
kind, under the `bench.common.header`. The timers add a Python call per part: compare passes of
this benchmark with each other, and whole passes with `bench.threads`. The wrappers are removed
when the run ends (`PartTimers.__exit__`).
"""

from __future__ import annotations

import collections
import time

import torch

import engine.models.llama as llama
from bench.common import arg_parser, write_json
from bench.threads import BS, _run, computed_contexts, use_worker_kernels
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.runner import ModelRunner

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
GLUE_OPS = ("rope_split", "add_norm", "silu_mul")
MODULE_PARTS = {"attention": "paged_attention", "store_kv": "store_kv", "rms_norm": "_rms_norm"}
"""Part name -> the `engine.models.llama` module global the layers call it through."""


class PartTimers:
    """Context manager wrapping a `engine.models.llama.LlamaModel`'s parts in timers (module
    docstring); ``seconds[part]`` accumulates, ``calls[part]`` counts, `reset` zeroes both. On
    exit every wrapped attribute is set back to what it was, whatever happened inside.

    Raises:
        TypeError: ``model`` is not a `LlamaModel` (the parts are its attributes).
    """

    def __init__(self, model):
        if not isinstance(model, llama.LlamaModel):
            raise TypeError(f"bench.step_parts times a LlamaModel's parts, not a {type(model).__name__}")
        self.model = model
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self._undo: list[tuple[object, str, object, bool]] = []

    def _wrap(self, owner, attr: str, part: str) -> None:
        fn = getattr(owner, attr)
        if fn is None:
            return
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                calls[part] += 1

        self._undo.append((owner, attr, fn, attr in vars(owner)))   # False: a method of its class
        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def __enter__(self) -> "PartTimers":
        m = self.model
        try:
            for layer in m._layers:
                for name in PROJECTIONS:
                    self._wrap(layer, name, name)
            self._wrap(m, "_lm_head", "head")
            for part, name in MODULE_PARTS.items():
                self._wrap(llama, name, part)
            if m.glue is not None:
                for name in GLUE_OPS:
                    self._wrap(m.glue, name, f"glue.{name}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            owner, attr, fn, own = self._undo.pop()
            if own:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)


def time_parts(runner: ModelRunner, pool: KVPool, reps: int, context: int,
               rows: tuple[int, ...]) -> dict[str, dict]:
    """``{pass kind: {"pass_ms", "parts_ms": {part: ms}, "rest_ms"}}`` for ``"decode x<rows>"``
    and ``"prefill <context>"`` (one prompt of ``context`` tokens), each the mean
    over ``reps`` timed passes (after two untimed ones) of ``runner`` over ``pool``; the blocks
    taken are given back. Raises the allocator's error when ``pool`` cannot hold the largest
    batch's contexts."""
    out = {}
    with PartTimers(runner.model) as timers:
        def measure(chunks) -> dict:
            for _ in range(2):
                _run(runner, pool, chunks)
            timers.reset()
            start = time.perf_counter()
            for _ in range(reps):
                _run(runner, pool, chunks)
            total = (time.perf_counter() - start) / reps
            parts = {k: v / reps * 1e3 for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
            return {"pass_ms": total * 1e3, "parts_ms": parts, "rest_ms": total * 1e3 - sum(parts.values())}

        for batch in rows:
            with computed_contexts(runner, pool, batch, context) as (prompts, step):
                out[f"decode x{batch}"] = measure(step)
                if batch == rows[0]:
                    out[f"prefill {context}"] = measure(prompts[:1])
    return out


def table(result: dict[str, dict]) -> str:
    """The markdown table of `time_parts`' result: a row per part (ms per pass and its share),
    a column per pass kind, the pass itself first and ``rest`` last."""
    kinds = list(result)
    parts = list(dict.fromkeys(p for r in result.values() for p in r["parts_ms"]))
    lines = ["| part | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|",
             "| **pass** | " + " | ".join(f"{result[k]['pass_ms']:.2f}" for k in kinds) + " |"]

    def cell(k: str, ms: float | None) -> str:
        return "-" if ms is None else f"{ms:.2f} ({100 * ms / result[k]['pass_ms']:.0f}%)"

    for p in parts:
        lines.append(f"| {p} | " + " | ".join(cell(k, result[k]["parts_ms"].get(p)) for k in kinds) + " |")
    lines.append("| rest | " + " | ".join(cell(k, result[k]["rest_ms"]) for k in kinds) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = arg_parser("bench.step_parts", __doc__)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every pass")
    ap.add_argument("--rows", default="1,8,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "grouped"],
                    help="auto (default): the compiled attention kernels a CPU worker runs; grouped: SDPA")
    ap.add_argument("--linear-backend", default="auto", choices=["auto", "onednn", "torch", "template"],
                    help="the projections' kernels (engine.linear; template: inductor's GEMM template for 2-64 rows)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        ap.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if min(rows) < 1 or args.context < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--rows, --context, --reps and --threads must be positive")
    torch.set_num_threads(args.threads)
    loaded = load_model(None, weights=args.weights, linear_backend=args.linear_backend)
    per_seq = -(-(args.context + 1) // BS)
    pool = KVPool(loaded.config, CacheConfig(block_size=BS, num_blocks=max(rows) * per_seq + 8,
                                             dtype=loaded.kv_dtype))
    if args.attention_backend == "auto":
        built = use_worker_kernels(loaded.model, pool, counts=(args.threads,), prompt_threads=args.threads)
        print(f"attention kernels built in {built:.1f} s, the decode kernel from "
              f"{loaded.model.decode_kernel.min_rows} row(s) up", flush=True)
    runner = ModelRunner(loaded.model, pool, parallel_min_tokens=0)
    result = time_parts(runner, pool, args.reps, args.context, rows)
    print(f"ms per pass, {args.threads} thread(s), {args.weights} weights, mean of {args.reps}:")
    print(table(result))
    if args.json:
        write_json(args.json, {"passes": result}, args)
    return result


if __name__ == "__main__":
    main()
