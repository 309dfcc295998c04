"""Forward-pass time per phase and batch size on 1 and 2 torch threads, alone and beside a busy
neighbour, and with threads chosen per pass (`engine.runner.ModelRunner`'s ``parallel_min_tokens``).

    python -m bench.threads [--weights native] [--attention-backend auto|grouped] [--reps 7]
                            [--compiled] [--tp N] [--eager-ops] [--json PATH]

Each row times one kind of pass of the default model through a `ModelRunner` (median of
``--reps``, after a warm-up): a prefill chunk of 256 prompt tokens, and decode steps of 1, 8 and
32 sequences with 256-token contexts, through the attention kernels a CPU worker runs
(``--attention-backend auto``, built before the timing for 1 and 2 threads, the prompt kernel
kept for the lengths it beat SDPA at on one thread: `use_worker_kernels`) or SDPA over gathered
K/V (``grouped``). Columns, side by side in one run:

- ``1t``: one thread;
- ``2t``: two threads, the machine otherwise idle;
- ``2t+busy``: two threads while another process spins on CPU 0 (what a serving worker meets:
  the router, the HTTP clients, a second worker share the cores);
- ``1t+busy``: one thread pinned to CPU 1 beside that neighbour;
- ``per pass+busy``: two threads for passes of at least ``--parallel-min-tokens`` tokens, one
  below (the workers' default), beside the neighbour.
- with ``--eager-ops``: ``1t eager ops`` / ``2t eager ops``, the first two columns again with the
  operators between the matmuls eager instead of the fused packages a worker runs
  (`engine.glue.CompiledGlue`, part of ``--attention-backend auto``'s kernels), timed beside
  them (1t eager ops before 1t, 2t after 2t: neither side always first).

- with ``--tp N``: ``TP<N>``: the model sharded over N processes of one thread each (`engine.tp`;
  two all-reduces per layer over gloo on 127.0.0.1). SmolLM2-135M's 9 heads split 3 ways only: on
  a 2-core machine its 3 ranks share 2 cores, so the column shows TP's overhead there, not a gain.
- with ``--compiled``: ``compiled 1t`` / ``compiled 2t``, the same passes through the compiled
  layers (`engine.compiled`), and the seconds their graphs took to build (printed and in the JSON;
  a second run finds inductor's caches on disk).

The neighbour is a Python busy loop in a subprocess pinned to CPU 0 (named ``bench-neighbour``,
stopped at the end). Needs at least 2 CPUs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch

from bench.common import arg_parser, median_time, write_json
from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.flex_prefill import CompiledPrefill
from engine.glue import CompiledGlue
from engine.kv_cache import KVPool
from engine.loader import load_model, make_pool
from engine.paged_decode import CompiledDecode
from engine.prefill_choice import choose_prefill_lengths
from engine.runner import ModelRunner
from worker.config import WorkerConfig
from worker.kernels import warm_kernel_alone

CONTEXT = 256
BS = 16


class Neighbour:
    """A busy-looping Python process named ``bench-neighbour`` (its argv[0]), pinned to
    ``cpu``; `stop` kills it and waits for it."""

    def __init__(self, cpu: int):
        self.proc = subprocess.Popen(["bench-neighbour", "-c", "while True: pass"], executable=sys.executable)
        os.sched_setaffinity(self.proc.pid, {cpu})

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def computed_contexts(runner: ModelRunner, pool: KVPool, batch: int, context: int):
    """``batch`` sequences of one seeded random prompt of ``context`` tokens, each computed once
    through ``runner`` into blocks of ``pool``; yields ``(prompts, step)``: the prompt chunks and
    the decode step of one token after each. The blocks are given back on exit. Raises the
    allocator's error when ``pool`` has too few free blocks."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, runner.model.config.vocab_size, (context,), generator=gen).tolist()
    per_seq = -(-(context + 1) // pool.block_size)
    chunks = []
    try:
        for _ in range(batch):
            chunks.append(SeqChunk(prompt, 0, pool.allocator.allocate(per_seq)))
        for c in chunks:
            _run(runner, pool, [c])
        yield chunks, [SeqChunk([prompt[0]], context, c.block_table) for c in chunks]
    finally:
        for c in chunks:
            pool.allocator.free(c.block_table)


def time_passes(runner: ModelRunner, pool: KVPool, reps: int, context: int = CONTEXT,
                batches: tuple[int, ...] = (1, 8, 32)) -> dict[str, float]:
    """Median seconds of each pass kind (module docstring) through ``runner`` over ``pool``:
    ``"prefill <context>"`` and ``"decode x<batch>"``; the blocks taken are given back."""
    out = {}
    for batch in batches:
        with computed_contexts(runner, pool, batch, context) as (chunks, step):
            out[f"decode x{batch}"] = median_time(lambda: _run(runner, pool, step), reps)
            if batch == 1:
                out[f"prefill {context}"] = median_time(lambda: _run(runner, pool, chunks), reps)
    return out


def use_worker_kernels(model, pool: KVPool, counts: tuple[int, ...] = (1, 2), glue: bool = True,
                       prompt_threads: int | None = 1) -> float:
    """Give ``model`` the compiled kernels a CPU decode worker runs by default
    (``--attention-backend auto``: `CompiledDecode` for decode rows, `CompiledPrefill` for prompt
    chunks, and with ``glue`` where the model takes it `CompiledGlue` for the operators between
    the matmuls), each built alone for every torch thread count in ``counts`` as a worker builds
    them (`worker.kernels.warm_kernel_alone`), the decode kernel's ``min_rows`` measured as a
    worker measures it (`worker.kernels`; its passes under ``parallel_min_tokens`` rows on one
    thread, as a worker's by default), and with ``prompt_threads`` the prompt kernel timed
    against SDPA on that many threads and kept only for the chunk lengths it won, as a worker of
    that many threads keeps it (`engine.prefill_choice`; None: kept from its default length, as
    ``--attention-backend compiled``); returns the seconds the builds took. Raises inductor's
    errors where it cannot build here."""
    kinds = [("decode_kernel", CompiledDecode), ("prefill_kernel", CompiledPrefill)]
    if glue and model.glue_applies():
        kinds.append(("glue", CompiledGlue))
    seconds = sum(warm_kernel_alone(model, pool, attr, kind(), counts) for attr, kind in kinds)
    model.measure_decode_rows(pool, lambda rows: 1)
    if prompt_threads is not None:
        choice = choose_prefill_lengths(model, model.prefill_kernel, *pool.layer_view(0), prompt_threads)
        print(f"prompt attention: {choice}", flush=True)
    return seconds


def _run(runner: ModelRunner, pool: KVPool, chunks: list[SeqChunk]) -> None:
    batch = ForwardBatch.build(chunks, pool.block_size)
    runner.set_pass_threads(batch.input_ids.numel())
    runner.model.forward(batch, pool)


def main(argv=None) -> dict:
    ap = arg_parser("bench.threads", __doc__)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--parallel-min-tokens", type=int, default=WorkerConfig.parallel_min_tokens,
                    help="default: a worker's")
    ap.add_argument("--compiled", action="store_true",
                    help="also the compiled layers (engine.compiled) on 1 and 2 threads, and their build time")
    ap.add_argument("--tp", type=int, default=0, help="also the model at this tensor parallel size, one thread per rank")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "grouped"],
                    help="auto (default): the compiled attention kernels a CPU worker runs; grouped: "
                         "SDPA over gathered K/V")
    ap.add_argument("--eager-ops", action="store_true",
                    help="also 1t and 2t with the operators between the matmuls eager (no engine.glue packages)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("error: needs at least 2 CPUs", file=sys.stderr)
        return {}
    cpus = sorted(os.sched_getaffinity(0))[:2]
    torch.set_num_threads(2)
    loaded = load_model(None, weights=args.weights)
    pool = KVPool(loaded.config, CacheConfig(block_size=BS, num_blocks=32 * 20, dtype=loaded.kv_dtype))
    if args.attention_backend == "auto":
        print(f"attention kernels built in {use_worker_kernels(loaded.model, pool):.1f} s, the decode kernel "
              f"from {loaded.model.decode_kernel.min_rows} row(s) up", flush=True)
    columns = {}

    def run(name, threads, per_pass=0, busy=False, pin=None, model=None, kv=None):
        torch.set_num_threads(threads)
        runner = ModelRunner(model or loaded.model, kv or pool, parallel_min_tokens=per_pass)
        neighbour = Neighbour(cpus[0]) if busy else None
        old = os.sched_getaffinity(0)
        try:
            if pin is not None:
                os.sched_setaffinity(0, {pin})
            columns[name] = time_passes(runner, kv or pool, args.reps)
        finally:
            os.sched_setaffinity(0, old)
            if neighbour:
                neighbour.stop()

    def eager_ops(name, threads):   # the same column without the fused operators
        kept, loaded.model.glue = loaded.model.glue, None
        try:
            run(name, threads)
        finally:
            loaded.model.glue = kept

    if args.eager_ops and loaded.model.glue is not None:   # each beside its fused column, in turn first
        eager_ops("1t eager ops", 1)
        run("1t", 1)
        run("2t", 2)
        eager_ops("2t eager ops", 2)
    else:
        run("1t", 1)
        run("2t", 2)
    run("2t+busy", 2, busy=True)
    run("1t+busy", 1, busy=True, pin=cpus[1])
    run("per pass+busy", 2, per_pass=args.parallel_min_tokens, busy=True)
    if args.tp:
        torch.set_num_threads(1)
        tp = load_model(None, weights=args.weights, tensor_parallel_size=args.tp, threads=1)
        try:
            run(f"TP{args.tp}", 1, model=tp.model, kv=make_pool(tp, pool.cache))
        finally:
            tp.model.close()
    build_s = None
    if args.compiled:
        torch.set_num_threads(1)
        compiled = load_model(None, weights=args.weights, compiled=True).model
        build_s = compiled.warm_up(pool)
        print(f"compiled layers built in {build_s:.1f} s (inductor cache: "
              f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", flush=True)
        run("compiled 1t", 1, model=compiled)
        run("compiled 2t", 2, model=compiled)
    rows = list(columns["1t"])
    print(f"weights {args.weights}, attention {args.attention_backend}; ms per pass (median of {args.reps}); torch {torch.__version__}")
    print("| pass | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{columns[c][r] * 1e3:.1f}" for c in columns) + " |")
    result = {"weights": args.weights, "reps": args.reps, "parallel_min_tokens": args.parallel_min_tokens,
              "attention_backend": args.attention_backend,
              "compiled_build_s": build_s, "seconds": columns}
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
