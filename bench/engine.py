"""Engine throughput against Hugging Face transformers on the same weights and thread count.

    python -m bench.engine [--threads 1] [--quick] [--weights fp32,native] [--json PATH]

Measures, in one run and side by side:
- prefill tokens/s for one prompt of 128 / 512 / 2048 tokens (KV written to the pool / cache);
- decode tokens/s for a batch of 1 / 8 / 32 sequences (128-token prompts, 32 decode steps timed).
Transformers runs a plain ``model(...)`` loop with its KV cache (no ``generate`` overhead), so the
reference is as fast as transformers gets (float32: the weights dequantized from the GGUF). Each
``--weights`` mode runs beside it; the table gives ours / transformers and, for every mode but the
first, its speed-up over the first. The header names the CPU's instruction set as torch sees it
and each mode's kernel path (oneDNN packed or plain matmuls; int4 kernel up to how many rows).
"""

from __future__ import annotations

import time

import torch

from bench.common import arg_parser, median_time, write_json
from engine.config import CacheConfig, SchedulerConfig
from engine.generator import Generator
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.attention import ForwardBatch, SeqChunk
from engine.sampling import SamplingParams


def bench_prefill_ours(loaded, n: int, reps: int) -> float:
    pool = KVPool(loaded.config, CacheConfig(num_blocks=-(-n // 16) + 1, dtype=loaded.kv_dtype))
    blocks = pool.allocator.allocate(-(-n // 16))
    ids = torch.randint(100, 40000, (n,)).tolist()
    batch = ForwardBatch.build([SeqChunk(ids, 0, blocks)], 16)
    return n / median_time(lambda: loaded.model.forward(batch, pool), reps)


@torch.inference_mode()
def bench_prefill_hf(hf, n: int, reps: int) -> float:
    ids = torch.randint(100, 40000, (1, n))
    return n / median_time(lambda: hf(ids, use_cache=True, logits_to_keep=1), reps)


def bench_decode_ours(loaded, batch: int, prompt_len: int, steps: int) -> float:
    blocks_per_seq = -(-(prompt_len + steps + 2) // 16)
    pool = KVPool(loaded.config, CacheConfig(num_blocks=batch * blocks_per_seq, dtype=loaded.kv_dtype))
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


def bench_linears(path, backend: str, rows=(1, 2, 4, 8, 16, 32, 128), reps: int = 50,
                  every_layer: bool = False) -> list[dict]:
    """Layer 0's projections (wqkv, wo, gate/up, down) of the native weights, or with
    ``every_layer`` every layer's in forward order (their weights out of cache, as a step meets
    them and as the model times its choices at load), microseconds per set at each row count:
    the two low-bit kernels of `engine.quant.Int4Linear` (``int4_us``: torch's int4 kernel,
    bfloat16 inputs; ``nbits_us``: MatMulNBits, int8 inputs per block), the dense copy native
    mode falls back to, float32 (fp32 mode's path), all through ``backend``; and the W8A8 path
    measured but not taken (`engine.mlas.RowInt8MatMul`): its integer GEMM alone on already
    quantized rows (``int8_gemm_us``) and with the per-row quantization and the scaling back
    (``w8a8_us``). Where the faster low-bit kernel stops winning is ``max_int4_rows``."""
    from engine.linear import Linear
    from engine.mlas import RowInt8MatMul
    from engine.quant import Int4Linear
    from engine.loader import load_weights

    _, weights = load_weights(path, torch.float32, native=True)
    layers = weights.layers if every_layer else weights.layers[:1]
    quantized = [w for layer in layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    native = [Int4Linear(w, max_int4_rows=0, dense_backend=backend, kernels=("int4", "nbits")) for w in quantized]
    fp32 = [Linear(w.dequantize(), backend) for w in quantized]
    w8a8 = [RowInt8MatMul(w.dequantize()) for w in quantized]
    out = []
    for m in rows:
        xs = [torch.randn(m, w.shape[1]) for w in quantized]

        def run(fn) -> float:
            return median_time(lambda: [fn(i) for i in range(len(xs))], reps) * 1e6

        int4 = run(lambda i: native[i].int4(xs[i]))
        nbits = run(lambda i: native[i].nbits(xs[i]))
        dense = run(lambda i: native[i](xs[i]))   # max_int4_rows=0: always the dense copy
        f32 = run(lambda i: fp32[i](xs[i]))
        codes = [RowInt8MatMul.quantize(x)[0] for x in xs]
        gemm = run(lambda i: w8a8[i].gemm(codes[i]))
        full = run(lambda i: w8a8[i](xs[i]))
        out.append({"rows": m, "int4_us": int4, "nbits_us": nbits, "dense_us": dense, "fp32_us": f32,
                    "int8_gemm_us": gemm, "w8a8_us": full})
    return out


def kernel_path(loaded) -> str:
    """How this mode's projections run and its KV dtype, e.g. ``onednn float32, KV float32``."""
    model = loaded.model
    if getattr(model, "quantized", False):
        from engine.quant import dense_dtype

        rows, dense = model._layers[0].wqkv.max_int4_rows, str(dense_dtype()).removeprefix("torch.")
        head = model._lm_head.max_int8_rows
        return (f"{model.low_bit_kernel} (<= {rows} rows, measured at load), {model.linear_backend} {dense} above; lm_head Q8_0 on "
                f"onnxruntime MatMulNBits (<= {head} rows), {model.linear_backend} {dense} above; KV {loaded.kv_dtype}, attention float32")
    gemv = ", one row: sgemv copies (measured faster)" if model.gemv_copies else ""
    return f"{model._layers[0].wqkv.backend} {loaded.dtype}{gemv}, KV {loaded.kv_dtype}"


def main(argv=None) -> dict:
    ap = arg_parser("bench.engine", __doc__)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    ap.add_argument("--weights", default="fp32", help="comma-separated --weights modes (fp32, bf16, native)")
    ap.add_argument("--linears", action="store_true",
                    help="also time one layer's projections per row count: the low-bit kernels, dense copies, W8A8")
    ap.add_argument("--every-layer", action="store_true",
                    help="with --linears: every layer's projections in turn (out of cache, as a step meets them)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.weights.split(",") if m.strip()]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    models = {m: load_model(weights=m) for m in modes}
    first = models[modes[0]]
    hf = AutoModelForCausalLM.from_pretrained(str(first.path.parent), gguf_file=first.path.name,
                                              dtype=torch.float32).eval()
    reps, steps = (2, 8) if args.quick else (5, 32)
    shapes = [("prefill", n) for n in (128, 512, 2048)] + [("decode", b) for b in (1, 8, 32)]
    rows = []
    for phase, size in shapes:
        if phase == "prefill":
            theirs = bench_prefill_hf(hf, size, reps)
            ours = {m: bench_prefill_ours(models[m], size, reps) for m in modes}
        else:
            theirs = bench_decode_hf(hf, size, 128, steps)
            ours = {m: bench_decode_ours(models[m], size, 128, steps) for m in modes}
        for m in modes:
            rows.append({"phase": phase, "size": size, "weights": m, "pdserve_tok_s": ours[m],
                         "transformers_tok_s": theirs, "ratio": ours[m] / theirs,
                         "vs_first": ours[m] / ours[modes[0]]})
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"threads={args.threads}  model={first.config.name}  cpu={isa}  transformers=float32")
    for m in modes:
        print(f"  {m}: {kernel_path(models[m])}")
    print(f"{'phase':8} {'size':>6} {'weights':>8} {'pdserve tok/s':>14} {'transformers tok/s':>19} "
          f"{'ratio':>7} {'vs ' + modes[0]:>9}")
    for r in rows:
        label = "tokens" if r["phase"] == "prefill" else "batch"
        print(f"{r['phase']:8} {r['size']:>6} {r['weights']:>8} {r['pdserve_tok_s']:>14.1f} "
              f"{r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f}x {r['vs_first']:>8.2f}x  ({label})")
    result = {"threads": args.threads, "quick": args.quick, "cpu_capability": isa,
              "kernel_paths": {m: kernel_path(models[m]) for m in modes}, "rows": rows}
    if args.linears and "native" in models:
        from engine.quant import dense_dtype

        lin = bench_linears(models["native"].path, models["native"].model.linear_backend,
                            reps=(3 if args.every_layer else 10) if args.quick else (9 if args.every_layer else 50),
                            every_layer=args.every_layer)
        dense = str(dense_dtype()).removeprefix("torch.")
        which = "every layer's" if args.every_layer else "one layer's"
        print(f"\n{which} projections, microseconds per set (dense copy: {dense}; the model keeps "
              f"{models['native'].model.low_bit_kernel} up to {models['native'].model.max_int4_rows} rows)")
        print(f"{'rows':>5} {'int4':>9} {'nbits':>9} {'dense':>9} {'fp32':>9} {'int8 gemm':>10} {'w8a8':>9}")
        for r in lin:
            print(f"{r['rows']:>5} {r['int4_us']:>9.0f} {r['nbits_us']:>9.0f} {r['dense_us']:>9.0f} {r['fp32_us']:>9.0f} "
                  f"{r['int8_gemm_us']:>10.0f} {r['w8a8_us']:>9.0f}")
        print("(int8 gemm: W8A8's integer product alone; w8a8: with per-row quantization and scaling back)")
        result["linears"] = lin
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
