"""Peak memory and time of loading a sharded bfloat16 Hugging Face checkpoint, pdserve against transformers.

Builds (or reuses, under ``--dir``) a random bfloat16 checkpoint of Llama-3.2-1B's shape (hidden
2048, 16 layers, intermediate 8192, 32 heads, 8 KV heads, vocab 128256, llama3 rope scaling, tied
embeddings: 1.24 B parameters), written a shard at a time (`write_checkpoint`: no more than one
shard's tensors held, never the model in float32) into shards of at most ``--shard-mb`` with a
``model.safetensors.index.json``, plus the SmolLM2 tokenizer (what `engine.loader.load_model`
reads; its ids do not match the vocabulary, which loading does not care about).

Each row then runs in a fresh process, so that its peak resident memory (``VmHWM``) is its own,
with ``--threads`` torch threads:

    pdserve-bf16 / -fp32        engine.loader.load_weights (weights only)
    pdserve-model-bf16 / -fp32  engine.loader.load_model, then a KV pool of ``--pool-blocks``
                                (``--no-gemv-copies``: load_model(gemv_copies=False), a prefill
                                worker's; float32 otherwise keeps plain copies of the projections
                                beside the packed ones where they time faster, 2x by design)
    hf-bf16 / -fp32             transformers AutoModelForCausalLM.from_pretrained(dir, dtype=...),
                                then every parameter read once (transformers may keep bfloat16
                                parameters as views of the mapped files, resident only when
                                read; the peak before that read is in the JSON)

Per row: load seconds, resident MB before loading (the interpreter and its imports), peak MB,
the loaded weights' MB (parameters x the dtype's bytes), the pool's MB, and peak / (weights +
pool) against the 1.3 bound of issue 30.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import arg_parser, write_json

LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
ROWS = ("pdserve-bf16", "pdserve-fp32", "pdserve-model-bf16", "pdserve-model-fp32", "hf-bf16", "hf-fp32")
BOUND = 1.3


def llama_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a Llama checkpoint's tensors in Hugging Face's order (no ``lm_head``
    when tied)."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return out


def write_checkpoint(out: Path, cfg: dict, shard_bytes: int, seed: int = 0) -> int:
    """Write a random bfloat16 checkpoint of ``cfg``'s shape into ``out``: ``config.json``, shards
    ``model-0000i-of-0000n.safetensors`` of at most ``shard_bytes`` each (a tensor larger than that
    gets a shard of its own) and ``model.safetensors.index.json``. Weights ~N(0, 0.02), norms
    1 + ~N(0, 0.1). Holds one shard's tensors at a time. Returns the number of shards."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    groups, size = [[]], 0
    for name, shape in llama_tensors(cfg):
        nbytes = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name, shape in group:
            values = torch.randn(shape, generator=gen)
            shard[name] = (1 + 0.1 * values if name.endswith("norm.weight") else 0.02 * values).to(torch.bfloat16)
            del values
            weight_map[name] = file
            total += shard[name].nbytes
        save_file(shard, str(out / file), metadata={"format": "pt"})
        del shard
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return len(groups)


def save_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer (from the GGUF of the default model), saved into ``out`` by transformers."""
    import transformers

    from engine.modelfile import default_model_path

    path = default_model_path()
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)


def _status_mb(field: str) -> float:
    return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0]) / 1024


def child(row: str, path: Path, threads: int, pool_blocks: int, gemv_copies: bool = True) -> dict:
    """Load ``path`` as ``row`` says, in this process (call it in a fresh one)."""
    import torch

    torch.set_num_threads(threads)
    dtype = torch.float32 if row.endswith("fp32") else torch.bfloat16
    pool_mb, lazy_peak = 0.0, None
    if row.startswith("hf-"):
        import transformers

        start = _status_mb("VmRSS")
        t0 = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        seconds = time.perf_counter() - t0
        params = sum(p.numel() for p in model.parameters())   # a tied head is counted once
        lazy_peak = _status_mb("VmHWM")
        with torch.no_grad():   # bf16 parameters may be views of the mapped files, read on first use
            for p in model.parameters():
                p.sum()
    elif row.startswith("pdserve-model-"):
        from engine.config import CacheConfig
        from engine.kv_cache import KVPool
        from engine.loader import load_model

        start = _status_mb("VmRSS")
        t0 = time.perf_counter()
        loaded = load_model(path, weights=row.rsplit("-", 1)[1], gemv_copies=gemv_copies)
        pool = KVPool(loaded.config, CacheConfig(num_blocks=pool_blocks, dtype=loaded.kv_dtype))
        seconds = time.perf_counter() - t0
        pool_mb = pool.kv.nbytes / 2**20
        params = None
    else:
        from engine.loader import load_weights

        start = _status_mb("VmRSS")
        t0 = time.perf_counter()
        _, weights = load_weights(path, dtype)
        seconds = time.perf_counter() - t0
        tensors = {t.data_ptr(): t for t in _tensors(weights)}
        params = sum(t.numel() for t in tensors.values())
    gemv = getattr(loaded.model, "gemv_copies", None) if row.startswith("pdserve-model-") else None
    return {"row": row, "gemv_copies_kept": gemv, "seconds": round(seconds, 2), "start_mb": round(start), "peak_mb": round(_status_mb("VmHWM")),
            "params": params, "pool_mb": round(pool_mb), "bytes_per_param": dtype.itemsize,
            "untouched_peak_mb": lazy_peak and round(lazy_peak)}


def _tensors(weights):
    from dataclasses import fields

    yield from (weights.embed, weights.final_norm, weights.lm_head)
    for layer in weights.layers:
        yield from (getattr(layer, f.name) for f in fields(layer) if getattr(layer, f.name) is not None)


def checkpoint_params(path: Path) -> int:
    """Parameters stored in ``path``'s safetensors files (headers only)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                n = 1
                for s in f.get_slice(key).get_shape():
                    n *= s
                total += n
    return total


def main(argv=None) -> dict:
    ap = arg_parser("bench.load_memory", __doc__)
    ap.add_argument("--dir", default="/tmp/pdserve-llama32-1b-bf16", help="checkpoint directory (built if absent)")
    ap.add_argument("--shard-mb", type=int, default=1000, help="largest shard when building, MB")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-blocks", type=int, default=512, help="KV blocks (16 tokens) of the load_model rows")
    ap.add_argument("--no-gemv-copies", action="store_true", help="load_model(gemv_copies=False) in the model rows")
    ap.add_argument("--child", help="run one row in this process (internal)")
    ap.add_argument("--untied", action="store_true",
                    help="build the checkpoint with its own lm_head (as Llama 3 8B and 70B have it)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    path = Path(args.dir)
    if args.child:
        print(json.dumps(child(args.child, path, args.threads, args.pool_blocks, not args.no_gemv_copies)))
        return {}
    if not (path / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        shards = write_checkpoint(path, {**LLAMA32_1B, "tie_word_embeddings": not args.untied}, args.shard_mb << 20)
        save_tokenizer(path)
        print(f"built {path}: {shards} shards in {time.perf_counter() - t0:.0f} s", flush=True)
    params = checkpoint_params(path)
    shards = len(list(path.glob("*.safetensors")))
    result = {"dir": str(path), "params": params, "shards": shards, "runs": []}
    print(f"{params / 1e9:.3f} B parameters, {shards} shards, {args.threads} torch threads")
    print(f"{'row':20} {'load s':>7} {'start MB':>9} {'peak MB':>8} {'weights MB':>11} {'pool MB':>8} "
          f"{'peak/(w+p)':>11}  <= {BOUND}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for row in args.rows.split(","):
        out = subprocess.run([sys.executable, "-m", "bench.load_memory", "--child", row, "--dir", str(path),
                              "--threads", str(args.threads), "--pool-blocks", str(args.pool_blocks)]
                             + ["--no-gemv-copies"] * args.no_gemv_copies,
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"{row:20} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
            result["runs"].append({"row": row, "error": out.stderr[-2000:]})
            continue
        run = json.loads(out.stdout.strip().splitlines()[-1])
        run["weights_mb"] = round((run["params"] or params) * run["bytes_per_param"] / 2**20)
        run["ratio"] = round(run["peak_mb"] / (run["weights_mb"] + run["pool_mb"]), 3)
        run["within_bound"] = run["ratio"] <= BOUND
        result["runs"].append(run)
        print(f"{row:20} {run['seconds']:>7} {run['start_mb']:>9} {run['peak_mb']:>8} {run['weights_mb']:>11} "
              f"{run['pool_mb']:>8} {run['ratio']:>11}  {'yes' if run['within_bound'] else 'NO'}"
              + ("  (gemv copies kept)" if run.get("gemv_copies_kept") else ""), flush=True)
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
