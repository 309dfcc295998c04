"""Loading Llama-family weights from a GGUF file or a Hugging Face directory.

Both loaders return a `ModelConfig` and a `LlamaWeights` whose projections are already fused for
the model's forward pass: ``wqkv`` is ``[(num_heads + 2 * num_kv_heads) * head_dim, hidden]`` and
``w_gate_up`` is ``[2 * intermediate, hidden]`` (row-major, ``y = x @ W.T``).

GGUF specifics (source: llama.cpp ``convert_hf_to_gguf.py``, ``LlamaModel.permute``): the
converter permutes the rows of Q and K so that llama.cpp's rotary kernel can rotate adjacent
pairs; we undo it, so rotary here uses the Hugging Face "rotate half" convention. Quantized tensors
(Q4_1, Q8_0, ...) are dequantized with the ``gguf`` package, except with ``native=True``: then the
projections stored as Q4_0 / Q4_1 stay 4-bit (`engine.quant.Int4Weight`, run by the int4 kernel).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.modelfile import gguf_field, gguf_reader
from engine.quant import NATIVE_TYPES, Int4Weight

Projection = torch.Tensor | Int4Weight



@dataclass
class LayerWeights:
    """One decoder block. Shapes: see module docstring; norms are ``[hidden]``. A projection is a
    dense tensor, or an `Int4Weight` of the same logical shape when loaded natively."""

    attn_norm: torch.Tensor
    wqkv: Projection
    wo: Projection
    ffn_norm: torch.Tensor
    w_gate_up: Projection
    w_down: Projection


@dataclass
class LlamaWeights:
    """All weights. ``embed`` is ``[vocab, hidden]``; ``lm_head`` is ``embed`` itself when tied."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def load_weights(path: str | Path, dtype: torch.dtype = torch.float32,
                 native: bool = False) -> tuple[ModelConfig, LlamaWeights]:
    """Load a GGUF file or a Hugging Face directory (config.json + *.safetensors).

    Args:
        path: a ``.gguf`` file or a directory.
        dtype: parameter dtype (float32 or bfloat16) of every dense tensor.
        native: keep the GGUF's Q4_0 / Q4_1 projections 4-bit (`engine.quant`).
    Raises:
        ModelLoadError: missing/malformed file, unsupported architecture, or ``native`` for a
            model with no Q4_0 / Q4_1 projection (a Hugging Face directory, an F16 GGUF).
    """
    path = Path(path)
    if path.is_dir():
        if native:
            raise ModelLoadError(f"{path}: native weights need a GGUF file with Q4_0/Q4_1/Q4_K tensors; "
                                 "this is a Hugging Face directory (use fp32 or bf16)")
        return _load_hf_dir(path, dtype)
    if path.suffix == ".gguf" or path.is_file():
        return _load_gguf(path, dtype, native)
    raise ModelLoadError(f"not a model file or directory: {path}")


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


def _load_gguf(path: Path, dtype: torch.dtype, native: bool = False) -> tuple[ModelConfig, LlamaWeights]:
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
        layers.append(_fuse_layer(
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
    embed = _tensor(take("token_embd.weight"), dtype)
    lm_head = embed if cfg.tie_word_embeddings else _tensor(take("output.weight"), dtype)
    weights = LlamaWeights(embed=embed, layers=layers,
                           final_norm=_tensor(take("output_norm.weight"), dtype), lm_head=lm_head)
    _check_shapes(cfg, weights, path)
    return cfg, weights


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(dtype)


def _projection(parts: list, dtype: torch.dtype) -> Projection:
    """Row-stack projections: 4-bit when every part is (and the rows pack into the int4 kernel's
    tiles of 16), else dense (a mixed layer dequantizes)."""
    if all(isinstance(p, Int4Weight) for p in parts) and sum(p.shape[0] for p in parts) % 16 == 0:
        return parts[0] if len(parts) == 1 else Int4Weight.cat(parts)
    dense = [p.dequantize().numpy() if isinstance(p, Int4Weight) else p for p in parts]
    return _tensor(np.concatenate(dense, axis=0), dtype)


def _fuse_layer(cfg: ModelConfig, dtype: torch.dtype, **w) -> LayerWeights:
    return LayerWeights(
        attn_norm=_tensor(w["attn_norm"], dtype),
        wqkv=_projection([w["q"], w["k"], w["v"]], dtype),
        wo=_projection([w["o"]], dtype),
        ffn_norm=_tensor(w["ffn_norm"], dtype),
        w_gate_up=_projection([w["gate"], w["up"]], dtype),
        w_down=_projection([w["down"]], dtype),
    )


def _check_shapes(cfg: ModelConfig, w: LlamaWeights, path: Path) -> None:
    h, d = cfg.hidden_size, cfg.head_dim
    expected = {
        "embed": ((cfg.vocab_size, h), w.embed.shape),
        "lm_head": ((cfg.vocab_size, h), w.lm_head.shape),
        "wqkv": (((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), w.layers[0].wqkv.shape),
        "wo": ((h, cfg.num_heads * d), w.layers[0].wo.shape),
        "w_gate_up": ((2 * cfg.intermediate_size, h), w.layers[0].w_gate_up.shape),
        "w_down": ((h, cfg.intermediate_size), w.layers[0].w_down.shape),
    }
    for name, (want, got) in expected.items():
        if tuple(got) != want:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(got)}, expected {want}")


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, LlamaWeights]:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path}: no config.json")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {exc}") from exc
    if hf.get("model_type") not in ("llama", "mistral", None):
        raise ModelLoadError(f"{path}: unsupported model_type {hf.get('model_type')!r}")
    window = hf.get("sliding_window")
    if window is not None and int(window) < int(hf.get("max_position_embeddings", 2048)):
        raise ModelLoadError(f"{path}: sliding_window {window} (below the context) is not supported")
    if (hf.get("rope_scaling") or {}).get("rope_type", "default") not in ("default",):
        raise ModelLoadError(f"{path}: rope scaling {hf['rope_scaling']} is not supported")
    heads = int(hf["num_attention_heads"])
    cfg = ModelConfig(
        name=path.name,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        architecture=hf.get("model_type") or "llama",
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            raw.update(load_file(str(file)))
        except Exception as exc:
            raise ModelLoadError(f"{file}: malformed safetensors: {exc}") from exc

    def take(name: str) -> np.ndarray:
        if name not in raw:
            raise ModelLoadError(f"{path}: missing tensor {name}")
        return raw[name].float().numpy()

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(_fuse_layer(
            cfg, dtype,
            attn_norm=take(p + "input_layernorm.weight"),
            q=take(p + "self_attn.q_proj.weight"), k=take(p + "self_attn.k_proj.weight"),
            v=take(p + "self_attn.v_proj.weight"), o=take(p + "self_attn.o_proj.weight"),
            ffn_norm=take(p + "post_attention_layernorm.weight"),
            gate=take(p + "mlp.gate_proj.weight"), up=take(p + "mlp.up_proj.weight"),
            down=take(p + "mlp.down_proj.weight"),
        ))
    embed = _tensor(take("model.embed_tokens.weight"), dtype)
    if cfg.tie_word_embeddings or "lm_head.weight" not in raw:
        lm_head = embed
    else:
        lm_head = _tensor(take("lm_head.weight"), dtype)
    weights = LlamaWeights(embed=embed, layers=layers,
                           final_norm=_tensor(take("model.norm.weight"), dtype), lm_head=lm_head)
    _check_shapes(cfg, weights, path)
    return cfg, weights
