"""Weights and config from a GGUF file.

GGUF specifics (source: llama.cpp ``convert_hf_to_gguf.py``, ``LlamaModel.permute``): the
converter permutes the rows of Q and K so that llama.cpp's rotary kernel can rotate adjacent
pairs; we undo it, so rotary here uses the Hugging Face "rotate half" convention. Quantized tensors
(Q4_1, Q8_0, ...) are dequantized with the ``gguf`` package, except with ``native=True``: then the
projections stored as Q4_0 / Q4_1 stay 4-bit (`engine.quant.Int4Weight`, run by the int4 kernel).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.modelfile import gguf_field, gguf_reader
from engine.quant import NATIVE_TYPES, Int4Weight
from engine.weights import LlamaWeights, check_shapes, fuse_layer, to_tensor


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. ``w`` is ``[n_heads * head_dim, ...]``."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader, path: Path) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (only 'llama')")

    def need(key):
        value = gguf_field(reader, f"llama.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks llama.{key}")
        return value

    scaling = gguf_field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        name=str(gguf_field(reader, "general.name", path.stem)),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        architecture=arch,
    )


_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def load_gguf(path: Path, dtype: torch.dtype, native: bool = False) -> tuple[ModelConfig, LlamaWeights]:
    import gguf

    reader = gguf_reader(path)
    cfg = _gguf_config(reader, path)
    raw: dict[str, np.ndarray | Int4Weight] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        try:
            if native and kind in NATIVE_TYPES and tensor.name.split(".")[-2] in _PROJECTIONS:
                k = int(tensor.shape[0])   # ggml's ne[0]: the row length (in_features)
                raw[tensor.name] = Int4Weight.from_gguf(tensor.data, kind, (int(tensor.n_elements) // k, k))
            else:
                raw[tensor.name] = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot load {tensor.name} ({kind}): {exc}") from exc
    if native and not any(isinstance(v, Int4Weight) for v in raw.values()):
        raise ModelLoadError(f"{path}: native weights need Q4_0/Q4_1/Q4_K projections; this file has none "
                             "(use fp32 or bf16)")

    def take(name: str, permute_heads: int | None = None) -> np.ndarray | Int4Weight:
        if name not in raw:
            raise ModelLoadError(f"{path}: missing tensor {name}")
        array = raw[name]
        if permute_heads is not None:
            if isinstance(array, Int4Weight):
                rows = np.arange(array.shape[0])[:, None]
                return array.take_rows(unpermute_rotary_rows(rows, permute_heads)[:, 0])
            array = unpermute_rotary_rows(array, permute_heads)
        return array

    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layers.append(fuse_layer(
            cfg, dtype,
            attn_norm=take(p + "attn_norm.weight"),
            q=take(p + "attn_q.weight", cfg.num_heads),
            k=take(p + "attn_k.weight", cfg.num_kv_heads),
            v=take(p + "attn_v.weight"),
            o=take(p + "attn_output.weight"),
            ffn_norm=take(p + "ffn_norm.weight"),
            gate=take(p + "ffn_gate.weight"),
            up=take(p + "ffn_up.weight"),
            down=take(p + "ffn_down.weight"),
        ))
    embed = to_tensor(take("token_embd.weight"), dtype)
    lm_head = embed if cfg.tie_word_embeddings else to_tensor(take("output.weight"), dtype)
    weights = LlamaWeights(embed=embed, layers=layers,
                           final_norm=to_tensor(take("output_norm.weight"), dtype), lm_head=lm_head)
    check_shapes(cfg, weights, path)
    return cfg, weights
