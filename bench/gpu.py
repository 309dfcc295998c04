"""The engine and the cuda_ipc engine on a GPU, each beside its reference in the same run.

    python -m bench.gpu [--tokenizer DIR] [--batches 1,8,32,128] [--weights fp32,bf16]
                        [--no-compiled] [--no-graphs] [--no-ipc] [--quick] [--json PATH]

- **Engine**: a checkpoint of SmolLM2-135M's shapes (30 layers, 576 wide, 9 query heads and 3 KV
  heads of 64, random weights written by transformers: throughput depends on shapes, not values;
  the GPU machine has no GGUF) against transformers on the same GPU and dtype. Prefill: a batch of
  B prompts of 128 tokens in one pass; decode: B sequences after such prompts, 32 steps of one
  token each. Tokens per second, the engine eager, with decode steps replayed from CUDA graphs
  (`engine.cuda_graphs`; prefill stays eager), and compiled (``torch.compile``; on CUDA with its
  decode steps from CUDA graphs, as a worker runs with ``--no-enforce-eager``); transformers as
  ``model(...)`` with its KV cache (no ``generate``).
- **cuda_ipc**: a receiver process with a GPU pool (`kvtransfer.cuda_ipc`) and this process
  writing a KV-shaped plan into it (a Llama-3-8B-shaped layer set, 4096 then 16384 tokens: 512
  writes of 1 MiB, then of 4 MiB), GB/s of KV moved from the first post to the last immediate
  counted, against the copy ceiling: a torch device-to-device copy of the same bytes in this
  process. The two sizes split a transfer's time into a fixed part and a streaming rate
  (`fixed_and_streaming`). Then the throughput with `IPC_IN_FLIGHT` transfers posted back to back,
  as a decode worker receives several requests' KV at once, and where a round's time goes (every
  post returned, every write ACKed, every transfer counted; then step by step for cuda_ipc and shm,
  `bench.round_trace`). That plan is contiguous on both sides and becomes one copy; the same KV
  into the reader's blocks in reverse order (one range per block, as scattered as a decode pool's)
  is one cuda_ipc round more, and the copy kernel is measured alone on it for several launch
  shapes (`copy_kernel_rates`).
- Both sides of every prefill ratio are timed in turn, pass by pass (`paired_best`), transformers
  again beside each engine row; every figure is the best of its timed runs.

Runs on the CPU too (``--device cpu``, small sizes: a smoke test of this script), never for
figures.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import arg_parser, median_time, write_json
from bench.round_trace import pipe_round_trip_us, print_trace, trace_rounds, transfer_pool
from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig, kv_cache_dtype
from engine.kv_cache import KVPool
from engine.loader import load_model

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
               tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
PROMPT, STEPS, BS = 128, 32, 16
PREFILL_WARMUP = 3
"""Untimed prefill passes before the timed ones (the GPU's clocks rise after the idle of a load)."""
SECRET = b"bench-gpu-secret-0123456789abcdef"


def build_shapes_checkpoint(out: Path, tokenizer: Path, layers: int) -> Path:
    """A random checkpoint of SmolLM2's shapes (``layers`` of them) with its tokenizer files."""
    import transformers

    config = transformers.LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, reps: int, warmup: int = 1) -> float:
    """Median seconds of ``fn``, synchronized with the device (`bench.common.median_time`)."""
    return median_time(lambda: (fn(), _sync(device)), reps, warmup)


def paired_best(fns, device: str, reps: int, warmup: int) -> list[float]:
    """Best seconds of one call of each of ``fns``, timed in turn (``a b a b ...``, ``reps``
    rounds after ``warmup`` untimed ones), each call synchronized with the device: the host's and
    the GPU's drifts (clocks, a busy neighbour) fall on both sides of a ratio alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def prefill_sides(loaded, weights: str, batch: int, hf=None, steps: int = 0) -> tuple[KVPool, list, list[int], dict]:
    """A pool with room for ``batch`` prompts of `PROMPT` tokens and ``steps`` more tokens each,
    their block tables, the prompt's token ids, and ``{"ours": prefill pass, "theirs":
    transformers' pass of ``batch`` such prompts}`` (``theirs`` only with ``hf``), as callables."""
    per_seq = -(-(PROMPT + steps + 2) // BS)
    pool = KVPool(loaded.config, CacheConfig(block_size=BS, num_blocks=batch * per_seq + 1,
                                             dtype=kv_cache_dtype(weights)), device=loaded.model.device)
    ids = torch.randint(100, 40000, (PROMPT,)).tolist()
    tables = [pool.allocator.allocate(per_seq) for _ in range(batch)]
    prefill = ForwardBatch.build([SeqChunk(ids, 0, t) for t in tables], BS)
    fns = {"ours": lambda: loaded.model.forward(prefill, pool)}
    if hf is not None:
        hf_ids = torch.randint(100, 40000, (batch, PROMPT), device=loaded.model.device)
        fns["theirs"] = lambda: hf(hf_ids, use_cache=True, logits_to_keep=1)
    return pool, tables, ids, fns


@torch.inference_mode()
def engine_rates(loaded, weights: str, batch: int, reps: int, steps: int, hf=None,
                 graphs: bool = False) -> tuple[float, float, float | None]:
    """(prefill tok/s, decode tok/s, transformers' prefill tok/s or None) of ``batch`` sequences of
    `PROMPT` tokens (module doc): prefill as one pass of the batch, timed in turn with ``hf``'s
    (transformers, the same prompts' length, `paired_best`); decode as ``steps`` steps, best of
    the timed runs as `hf_decode_rate` takes transformers'. ``graphs``: decode steps replayed from
    CUDA graphs (`engine.cuda_graphs`, recorded first)."""
    device = str(loaded.model.device)
    pool, tables, ids, fns = prefill_sides(loaded, weights, batch, hf, steps)
    step = loaded.model.forward
    if graphs:
        from engine.cuda_graphs import DecodeGraphs

        recorded = DecodeGraphs(loaded.model, pool, batch, len(tables[0]) * BS)
        step = lambda b, pool: recorded.run(b)  # noqa: E731
    prefill_s = paired_best(list(fns.values()), device, 2 * reps, PREFILL_WARMUP)
    steps_batches = [ForwardBatch.build([SeqChunk([ids[0]], PROMPT + s, t) for t in tables], BS) for s in range(steps)]
    decode_s = paired_best([lambda: [step(b, pool) for b in steps_batches]], device, max(1, reps // 2), 1)[0]
    tok = batch * PROMPT
    return tok / prefill_s[0], batch * steps / decode_s, tok / prefill_s[1] if hf is not None else None


@torch.inference_mode()
def hf_decode_rate(hf, batch: int, reps: int, steps: int, device: str) -> float:
    """transformers' decode tok/s: ``steps`` one-token steps of ``batch`` sequences after prompts
    of `PROMPT` tokens, with its KV cache (best of the timed runs)."""
    ids = torch.randint(100, 40000, (batch, PROMPT), device=device)

    def decode():
        out = hf(ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = hf(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        return time.perf_counter() - t0

    decode()
    return batch * steps / min(decode() for _ in range(max(1, reps // 2)))


def _ipc_receiver(conn, nbytes: int, kind: str = "cuda_ipc") -> None:
    from kvtransfer import CompletionCounter, EngineConfig, create_engine

    counter = CompletionCounter(2 * IPC_IN_FLIGHT)
    engine = create_engine(kind, EngineConfig(secret=SECRET), arrivals=counter)
    pool, shared = transfer_pool(kind, nbytes)
    engine.register_memory(pool, shared=shared)
    conn.send(engine.describe().to_bytes())
    while (cmd := conn.recv()) is not None:
        if cmd == "ping":   # `ipc_rate`'s round trip between the two processes
            conn.send("pong")
            continue
        writes, in_flight = cmd
        slots = [counter.acquire(60.0) for _ in range(in_flight)]
        conn.send(slots)
        for slot, gen in slots:
            counter.expect(slot, gen, writes)
        for slot, gen in slots:
            counter.wait(slot, gen, 120.0)
            counter.release(slot, gen)
        conn.send("done")
    engine.close()


def ipc_rate(tokens: int, reps: int, in_flight: int = 1, kind: str = "cuda_ipc", scattered: bool = False) -> dict:
    """cuda_ipc GB/s on a KV-shaped plan beside the device-to-device copy ceiling (module doc):
    ``in_flight`` transfers of the plan posted back to back, each to its own slot of the receiver's
    counter (into the same pool bytes), timed from the first post to the last transfer counted.
    ``kind="shm"``: the same with host pools in shared memory (the software path cuda_ipc shares,
    without CUDA; its ceiling is a host copy). ``scattered``: the KV goes into the receiver's
    blocks in reverse order (one write per block, layer, K|V and head, as into a decode pool's
    blocks: the copy kernel's case) instead of the same blocks (writes that merge into one copy)."""
    from kvtransfer import EndpointInfo, EngineConfig, KVLayout, create_engine, pack_immediate, plan_writes, to_write_ops

    layout = KVLayout(32, -(-tokens // BS), BS, 8, 128, 2)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_receiver, args=(child, layout.total_bytes, kind), name="bench-ipc-receiver",
                       daemon=True)
    proc.start()
    child.close()   # ours: a receiver that dies then reads as EOFError, not a hang
    try:
        info = EndpointInfo.from_bytes(parent.recv())
        src, shared = transfer_pool(kind, layout.total_bytes)
        engine = create_engine(kind, EngineConfig(secret=SECRET))
        local = engine.register_memory(src, shared=shared)
        peer = engine.connect(info)
        ids = list(range(layout.num_blocks))
        plan = plan_writes(layout, layout, ids, ids[::-1] if scattered else ids, 1 << 22)
        times, posted, acked = [], [], []
        for _ in range(reps + 1):
            parent.send((len(plan), in_flight))
            slots = parent.recv()
            batches = [to_write_ops(plan, local, info.regions[0].key, pack_immediate(*slot)) for slot in slots]
            t0 = time.perf_counter()
            handles = [engine.post_writes(peer, ops) for ops in batches]
            posted.append(time.perf_counter() - t0)
            for handle in handles:
                engine.wait(handle, 120)
            acked.append(time.perf_counter() - t0)
            assert parent.recv() == "done"
            times.append(time.perf_counter() - t0)
        engine.close()
        round_trip_us = pipe_round_trip_us(parent)
        dst = torch.empty_like(src)
        copy_s = _time(lambda: dst.copy_(src), str(src.device), reps)
        nbytes = sum(w.length for w in plan)

        def median_us(xs: list[float]) -> float:   # the first round is a warm-up
            return sorted(xs[1:])[len(xs[1:]) // 2] * 1e6

        ipc_s = median_us(times) / 1e6 / in_flight
        return {"bytes": nbytes, "writes": len(plan), "bytes_per_write": nbytes // len(plan), "in_flight": in_flight,
                "ipc_gb_s": nbytes / ipc_s / 1e9, "copy_gb_s": nbytes / copy_s / 1e9, "ratio": copy_s / ipc_s,
                # where a round's time goes, from its first post: every post returned, every write
                # ACKed to the writer, every transfer counted by the receiver (the bench's pipe)
                "posted_us": median_us(posted), "acked_us": median_us(acked), "counted_us": median_us(times),
                # the host's floor under those: one message there and back between the two
                # processes (a pipe, each end blocked in recv), while nothing else runs
                "round_trip_us": round_trip_us}
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


COPY_SHAPES = ((1024, 64, 4), (512, 64, 4), (512, 64, 2), (256, 64, 2), (4096, 64, 8))
"""``(block, max_programs, num_warps)`` launches of `kvtransfer.copy_kernel.copy_ranges` measured
alone (`copy_kernel_rates`); the first is the default."""


def copy_kernel_rates(tokens: int, reps: int, device: str = "cuda") -> list[dict]:
    """The device copies of a KV plan of ``tokens`` into blocks in the reverse order (as scattered
    as a decode pool's: one range per block, layer, K|V and head, after `copy_plan`'s merging; the
    cuda_ipc rows' plan is contiguous on both sides and becomes one copy), in one process and
    without the protocol: `copy_ranges` for each of `COPY_SHAPES`, synchronized after each launch,
    beside a torch copy of the same bytes in one call."""
    from kvtransfer import KVLayout, MemoryRegion, copy_kernel, plan_writes, to_write_ops
    from kvtransfer.cuda_ipc import copy_plan

    layout = KVLayout(32, -(-tokens // BS), BS, 8, 128, 2)
    ids = list(range(layout.num_blocks))
    plan = plan_writes(layout, layout, ids, ids[::-1], 1 << 22)   # a decode pool's blocks are scattered
    ((_, ranges),) = copy_plan(to_write_ops(plan, MemoryRegion(0, layout.total_bytes, 1), 2, 0)).items()
    src = torch.randint(0, 255, (layout.total_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    nbytes = int(ranges[:, 2].sum())
    copy_s = _time(lambda: dst.copy_(src), device, reps)
    out = []
    for block, programs, warps in COPY_SHAPES:
        kernel_s = _time(lambda: copy_kernel.copy_ranges(dst, src, ranges, block=block, max_programs=programs,
                                                         num_warps=warps), device, reps, 2)
        out.append({"block": block, "max_programs": programs, "num_warps": warps, "ranges": len(ranges),
                    "bytes": nbytes, "kernel_gb_s": nbytes / kernel_s / 1e9, "copy_gb_s": nbytes / copy_s / 1e9,
                    "ratio": copy_s / kernel_s})
        if device == "cpu":   # under TRITON_INTERPRET=1 (a check of this function, not a figure)
            d, s, n = ranges[-1]
            assert torch.equal(dst[d:d + n], src[s:s + n])
    return out


def _print_row(r: dict) -> None:
    print(f"| {r['weights']} | {r['step']} | {r['phase']} | {r['batch']} | "
          f"{r['pdserve_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | {r['ratio']:.2f}x |", flush=True)


IPC_TOKENS = (4096, 16384)
"""Context lengths of the two cuda_ipc plans: 512 writes each (32 layers x K|V x 8 KV heads), of
1 MiB and 4 MiB."""
IPC_IN_FLIGHT = 8
"""Transfers posted back to back in the throughput rows (a decode worker receives several
requests' KV at once)."""


def fixed_and_streaming(sizes: list[dict]) -> dict:
    """Two `ipc_rate` results with the same write count, as ``time = fixed + bytes / streaming``:
    ``fixed_us`` (the transfer's cost whatever its bytes: Python per write and per batch, the
    NOTIFY and the receiver's counting) and ``streaming_gb_s`` (the copies' own rate)."""
    (b0, t0), (b1, t1) = ((r["bytes"], r["bytes"] / r["ipc_gb_s"] / 1e9) for r in sizes)
    per_byte = (t1 - t0) / (b1 - b0)
    return {"fixed_us": (t0 - per_byte * b0) * 1e6, "streaming_gb_s": 1 / per_byte / 1e9 if per_byte > 0 else float("inf")}


def main(argv=None) -> dict:
    ap = arg_parser("bench.gpu", __doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", default=os.environ.get("PDSERVE_TOKENIZER_DIR"),
                    help="SmolLM2's tokenizer files (deploy.gpucheck prepare writes them)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--weights", default="fp32,bf16")
    ap.add_argument("--no-compiled", action="store_true")
    ap.add_argument("--no-graphs", action="store_true", help="no rows with decode steps from CUDA graphs")
    ap.add_argument("--no-ipc", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 steps: a smoke test")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no section (a dtype's eager, graphs or compiled rows, cuda_ipc) after this many seconds; "
                         "each row is printed and the JSON rewritten as it is measured")
    ap.add_argument("--shm-rounds", action="store_true",
                    help="only the rounds of 512 writes of 4 KiB over shm, 1 and IPC_IN_FLIGHT in flight (any machine)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.shm_rounds:
        rounds = {"shm_rounds": [ipc_rate(16, 21, n, kind="shm") for n in (1, IPC_IN_FLIGHT)]}
        for r in rounds["shm_rounds"]:
            print(f"shm, {r['in_flight']} in flight, {r['writes']} writes of {r['bytes_per_write'] // 1024} KiB: posted "
                  f"after {r['posted_us']:.0f} us, acked {r['acked_us']:.0f} us, counted {r['counted_us']:.0f} us; "
                  f"a round trip between the processes {r['round_trip_us']:.0f} us")
        if args.json:
            write_json(args.json, rounds, args)
        return rounds
    import transformers

    if not args.tokenizer:
        raise SystemExit("--tokenizer DIR (or PDSERVE_TOKENIZER_DIR) is needed: SmolLM2's tokenizer files")
    t0 = time.monotonic()

    def late(what: str, need_s: float = 0.0) -> bool:
        if args.deadline_s is not None and time.monotonic() - t0 + need_s > args.deadline_s:
            print(f"(skipped for the deadline: {what})", flush=True)
            result["skipped"].append(what)
            return True
        return False

    reps, steps, layers = (2, 4, 2) if args.quick else (5, STEPS, SMOLLM2["num_hidden_layers"])
    batches = [int(b) for b in args.batches.split(",")]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows: list[dict] = []
    result = {"device": name, "layers": layers, "prompt_tokens": PROMPT, "decode_steps": steps, "rows": rows,
              "skipped": []}

    def save() -> None:
        if args.json:
            write_json(args.json, result, args)

    print(f"engine vs transformers on {name} (SmolLM2-135M shapes, {layers} layers; prompts of {PROMPT})")
    print("| weights | step | phase | batch | pdserve tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|---|---|---|", flush=True)
    dtypes = args.weights.split(",")
    # eager rows first, then cuda_ipc, CUDA graphs, and the compiled rows (their build takes the longest)
    cuda = args.device.startswith("cuda")
    order = ([(w, "eager") for w in dtypes] + ([("ipc", None)] if not args.no_ipc and cuda else [])
             + ([(w, "graphs") for w in reversed(dtypes)] if cuda and not args.no_graphs else [])
             # what a GPU worker runs with --no-enforce-eager: compiled layers, decode from CUDA graphs
             + ([] if args.no_compiled else [(w, "compiled+graphs" if cuda and not args.no_graphs else "compiled")
                                             for w in reversed(dtypes)]))
    theirs: dict[str, dict[int, float]] = {}   # transformers' decode tok/s per dtype and batch
    hf_models: dict[str, torch.nn.Module] = {}   # kept: its prefill is measured beside each row
    with tempfile.TemporaryDirectory() as tmp:
        path = build_shapes_checkpoint(Path(tmp) / "smollm2-shapes", Path(args.tokenizer), layers)
        for weights, mode in order:
            if weights == "ipc":
                sizes = result["cuda_ipc_sizes"] = []
                for tokens in (512,) if args.quick else IPC_TOKENS:
                    if late(f"cuda_ipc {tokens} tokens"):
                        break
                    sizes.append(ipc := ipc_rate(tokens, reps))
                    result.setdefault("cuda_ipc", ipc)
                    print(f"cuda_ipc: {ipc['writes']} writes of {ipc['bytes_per_write'] / 2**20:.2f} MiB: "
                          f"{ipc['ipc_gb_s']:.1f} GB/s vs a device copy of the same bytes {ipc['copy_gb_s']:.1f} "
                          f"GB/s ({ipc['ratio']:.2f}x the ceiling); posted after {ipc['posted_us']:.0f} us, "
                          f"acked {ipc['acked_us']:.0f} us, counted {ipc['counted_us']:.0f} us; a round trip between the "
                          f"processes {ipc['round_trip_us']:.0f} us", flush=True)
                    if tokens == IPC_TOKENS[0] and not late("cuda_ipc, a scattered plan"):
                        result["cuda_ipc_scattered"] = sc = ipc_rate(tokens, reps, scattered=True)
                        print(f"cuda_ipc, the same KV into blocks in reverse order: {sc['writes']} writes of "
                              f"{sc['bytes_per_write'] / 2**10:.0f} KiB: {sc['ipc_gb_s']:.1f} GB/s "
                              f"({sc['ratio']:.2f}x the ceiling); posted after {sc['posted_us']:.0f} us, acked "
                              f"{sc['acked_us']:.0f} us, counted {sc['counted_us']:.0f} us", flush=True)
                    kernel = result.setdefault("copy_kernel", [])
                    for k in copy_kernel_rates(tokens, reps) if not kernel else []:   # the first size's plan
                        kernel.append(k)
                        print(f"copy_ranges alone, {k['ranges']} ranges of {k['bytes'] / k['ranges'] / 2**20:.2f} MiB, "
                              f"block {k['block']} x {k['max_programs']} programs, {k['num_warps']} warps: "
                              f"{k['kernel_gb_s']:.1f} GB/s ({k['ratio']:.2f}x the copy)", flush=True)
                    save()
                if len(sizes) == 2:
                    result["cuda_ipc_fit"] = fit = fixed_and_streaming(sizes)
                    print(f"cuda_ipc per transfer of {sizes[0]['writes']} writes: {fit['fixed_us']:.0f} us fixed, "
                          f"then {fit['streaming_gb_s']:.0f} GB/s (copy ceiling {sizes[-1]['copy_gb_s']:.0f} GB/s)",
                          flush=True)
                if not late("shm, 512 writes of 4 KiB"):   # the same path without CUDA, on this host
                    result["shm_small"] = shm = ipc_rate(16, reps, kind="shm")
                    print(f"shm (host pools), {shm['writes']} writes of {shm['bytes_per_write'] / 2**10:.0f} KiB: "
                          f"posted after {shm['posted_us']:.0f} us, acked {shm['acked_us']:.0f} us, counted "
                          f"{shm['counted_us']:.0f} us; a round trip between the processes {shm['round_trip_us']:.0f} us", flush=True)
                if not late("the traced rounds"):   # where a round's time goes, step by step
                    result["round_trace"] = traces = [trace_rounds("cuda_ipc", 512, 1 << 20, 10 if args.quick else 20),
                                                      trace_rounds("shm", 512, 4096, 10 if args.quick else 20)]
                    for trace in traces:
                        print_trace(trace)
                    save()
                piped = result["cuda_ipc_in_flight"] = []
                for tokens in (512,) if args.quick else IPC_TOKENS:
                    if late(f"cuda_ipc {tokens} tokens, {IPC_IN_FLIGHT} in flight"):
                        break
                    piped.append(ipc := ipc_rate(tokens, reps, IPC_IN_FLIGHT))
                    print(f"cuda_ipc, {IPC_IN_FLIGHT} transfers in flight: {ipc['writes']} writes of "
                          f"{ipc['bytes_per_write'] / 2**20:.2f} MiB each: {ipc['ipc_gb_s']:.1f} GB/s vs "
                          f"{ipc['copy_gb_s']:.1f} GB/s ({ipc['ratio']:.2f}x the ceiling)", flush=True)
                    save()
                continue
            label = f"{weights} {mode}"
            if late(label, 60.0 if mode.startswith("compiled") else 0.0):
                continue
            if weights not in theirs:
                dtype = torch.float32 if weights == "fp32" else torch.bfloat16
                hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device).eval()
                hf_models[weights] = hf
                theirs[weights] = {b: hf_decode_rate(hf, b, reps, steps, args.device) for b in batches}
            built = time.monotonic()
            loaded = load_model(path, weights=weights, device=args.device, compiled=mode.startswith("compiled"))
            for b in batches:
                if late(f"{label} batch {b}"):
                    break
                *ours, prefill_theirs = engine_rates(loaded, weights, b, reps, steps, hf_models[weights],
                                                     graphs=mode.endswith("graphs"))
                for i, phase in enumerate(("prefill", "decode")):
                    ref = prefill_theirs if phase == "prefill" else theirs[weights][b]
                    rows.append({"weights": weights, "step": mode, "compiled": mode.startswith("compiled"), "phase": phase,
                                 "batch": b, "pdserve_tok_s": ours[i], "transformers_tok_s": ref,
                                 "ratio": ours[i] / ref})
                    _print_row(rows[-1])
                save()
            if mode == "eager" and weights == dtypes[-1] and not late("prefill kernels"):   # bench.prefill_profile
                from bench.prefill_profile import prefill_kernels, print_kernels

                sides = prefill_sides(loaded, weights, max(batches), hf_models[weights])[3]
                result["prefill_kernels"] = kernels = prefill_kernels(sides, args.device, 2 if args.quick else 3)
                print_kernels(kernels, f"{weights} prefill, batch {max(batches)}")
                save()
            if mode != "eager":   # graphs are built before timing, compiled ones in the untimed warm-up
                print(f"({label}: loaded and measured in {time.monotonic() - built:.0f} s, graphs built included)",
                      flush=True)
            del loaded
    save()
    return result


if __name__ == "__main__":
    main()
