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
from engine.models.hf_config import model_config_from_hf
from engine.models.moe import ExpertWeights
from engine.quant import NATIVE_TYPES, Int4Weight

Projection = torch.Tensor | Int4Weight



@dataclass
class LayerWeights:
    """One decoder block. Shapes: see module docstring; norms are ``[hidden]``. A projection is a
    dense tensor, or an `Int4Weight` of the same logical shape when loaded natively. Present only
    when the config asks for them: ``bqkv`` ``[(num_heads + 2 * num_kv_heads) * head_dim]``, ``bo``
    ``[hidden]``, ``q_norm`` / ``k_norm`` ``[head_dim]``; in a layer of `ModelConfig.moe_layers`,
    ``experts`` (`engine.models.moe.ExpertWeights`) and no ``w_gate_up`` / ``w_down`` (None)."""

    attn_norm: torch.Tensor
    wqkv: Projection
    wo: Projection
    ffn_norm: torch.Tensor
    w_gate_up: Projection | None
    w_down: Projection | None
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    experts: ExpertWeights | None = None


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
    """A layer's weights, Q/K/V and gate/up fused; without ``gate`` (an MoE layer) no dense MLP."""
    dense = "gate" in w
    return LayerWeights(
        attn_norm=_tensor(w["attn_norm"], dtype),
        wqkv=_projection([w["q"], w["k"], w["v"]], dtype),
        wo=_projection([w["o"]], dtype),
        ffn_norm=_tensor(w["ffn_norm"], dtype),
        w_gate_up=_projection([w["gate"], w["up"]], dtype) if dense else None,
        w_down=_projection([w["down"]], dtype) if dense else None,
    )


def _hf_qkv(cfg: ModelConfig, take, prefix: str) -> dict:
    """A layer's Q, K and V weights; Phi-3 stores them stacked in one ``qkv_proj``."""
    a = prefix + "self_attn."
    if cfg.architecture != "phi3":
        return {x: take(f"{a}{x}_proj.weight") for x in "qkv"}
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = np.split(take(a + "qkv_proj.weight"), [q_rows, q_rows + kv_rows])
    return {"q": q, "k": k, "v": v}   # a wrong row count shows as a wrong wqkv (`_check_shapes`)


def _hf_mlp(cfg: ModelConfig, take, prefix: str) -> dict:
    """A dense layer's gate, up and down weights; Phi-3 stacks gate and up in ``gate_up_proj``."""
    m = prefix + "mlp."
    if cfg.architecture != "phi3":
        return {x: take(f"{m}{x}_proj.weight") for x in ("gate", "up", "down")}
    gate, up = np.split(take(m + "gate_up_proj.weight"), 2)
    return {"gate": gate, "up": up, "down": take(m + "down_proj.weight")}


def _hf_experts(cfg: ModelConfig, take, prefix: str, dtype: torch.dtype) -> ExpertWeights:
    """A Hugging Face MoE layer's router and experts: Mixtral's ``block_sparse_moe`` (``w1`` gate,
    ``w3`` up, ``w2`` down) or Qwen3-MoE's ``mlp`` (``gate_proj``, ``up_proj``, ``down_proj``)."""
    if cfg.architecture == "mixtral":
        block, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    gate_up, down = [], []
    for e in range(cfg.num_experts):
        g, u, d = (take(f"{block}experts.{e}.{n}.weight") for n in names)
        gate_up.append(_tensor(np.concatenate([g, u]), dtype))
        down.append(_tensor(d, dtype))
    router = _tensor(take(block + "gate.weight"), dtype)
    want = (cfg.num_experts, cfg.hidden_size)
    if tuple(router.shape) != want or tuple(gate_up[0].shape) != (2 * cfg.moe_intermediate_size, cfg.hidden_size):
        raise ModelLoadError(f"{block}: router {tuple(router.shape)} / expert gate+up {tuple(gate_up[0].shape)} do "
                             f"not fit {cfg.num_experts} experts of width {cfg.moe_intermediate_size}")
    return ExpertWeights(router=router, gate_up=gate_up, down=down)


def _check_shapes(cfg: ModelConfig, w: LlamaWeights, path: Path) -> None:
    h, d = cfg.hidden_size, cfg.head_dim
    expected = {
        "embed": ((cfg.vocab_size, h), w.embed.shape),
        "lm_head": ((cfg.vocab_size, h), w.lm_head.shape),
        "wqkv": (((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), w.layers[0].wqkv.shape),
        "wo": ((h, cfg.num_heads * d), w.layers[0].wo.shape),
    }
    first = w.layers[0]
    if first.bqkv is not None:
        expected["bqkv"] = (((cfg.num_heads + 2 * cfg.num_kv_heads) * d,), first.bqkv.shape)
    if first.bo is not None:
        expected["bo"] = ((h,), first.bo.shape)
    if first.q_norm is not None:
        expected["q_norm / k_norm"] = ((d, d), (*first.q_norm.shape, *first.k_norm.shape))
    dense = next((layer for layer in w.layers if layer.w_gate_up is not None), None)
    if dense is not None:
        expected["w_gate_up"] = ((2 * cfg.intermediate_size, h), dense.w_gate_up.shape)
        expected["w_down"] = ((h, cfg.intermediate_size), dense.w_down.shape)
    for name, (want, got) in expected.items():
        if tuple(got) != want:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(got)}, expected {want}")


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, LlamaWeights]:
    """A Hugging Face directory: ``config.json`` (`engine.models.hf_config`) and its safetensors,
    each tensor read from its memory-mapped file when it is placed (`_SafetensorsDir`)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path}: no config.json")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {exc}") from exc
    cfg = model_config_from_hf(hf, path.name, f"{path}/config.json")
    files = _SafetensorsDir(path)
    take = files.take
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        moe = i in cfg.moe_layers
        mlp = {} if moe else _hf_mlp(cfg, take, p)
        layer = _fuse_layer(
            cfg, dtype, attn_norm=take(p + "input_layernorm.weight"), **_hf_qkv(cfg, take, p),
            o=take(p + "self_attn.o_proj.weight"), ffn_norm=take(p + "post_attention_layernorm.weight"), **mlp,
        )
        if moe:
            layer.experts = _hf_experts(cfg, take, p, dtype)
        if cfg.qkv_bias:
            layer.bqkv = _tensor(np.concatenate([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]), dtype)
        if cfg.o_bias:
            layer.bo = _tensor(take(p + "self_attn.o_proj.bias"), dtype)
        if cfg.qk_norm:
            layer.q_norm = _tensor(take(p + "self_attn.q_norm.weight"), dtype)
            layer.k_norm = _tensor(take(p + "self_attn.k_norm.weight"), dtype)
        layers.append(layer)
    embed = _tensor(take("model.embed_tokens.weight"), dtype)
    if cfg.tie_word_embeddings:
        lm_head = embed
        if "lm_head.weight" in files and not np.array_equal(take("lm_head.weight"), take("model.embed_tokens.weight")):
            raise ModelLoadError(f"{path}: tie_word_embeddings=True but lm_head.weight differs from the embedding")
    elif "lm_head.weight" in files:
        lm_head = _tensor(take("lm_head.weight"), dtype)
    else:
        raise ModelLoadError(f"{path}: tie_word_embeddings=False but the checkpoint has no lm_head.weight")
    weights = LlamaWeights(embed=embed, layers=layers,
                           final_norm=_tensor(take("model.norm.weight"), dtype), lm_head=lm_head)
    _check_shapes(cfg, weights, path)
    files.check_all_used()
    return cfg, weights


class _SafetensorsDir:
    """The tensors of a directory's safetensors files, by name, each read when asked for.

    The file of each name comes from ``model.safetensors.index.json`` (``weight_map``) when it
    exists, else from every ``*.safetensors`` file's header. Files are opened with
    ``safetensors.safe_open`` (memory-mapped: nothing is read before a tensor is taken).

    Raises:
        ModelLoadError: no safetensors file, a malformed file or index, a missing tensor, or
            (`check_all_used`) tensors the model does not use.
    """

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._path, self._open = path, {}
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ModelLoadError(f"{index}: malformed index: {exc}") from exc
            files = sorted(set(weight_map.values()))
        else:
            files, weight_map = [f.name for f in sorted(path.glob("*.safetensors"))], None
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors files")
        self._where: dict[str, str] = {}
        for name in files:
            try:
                handle = safe_open(str(path / name), framework="pt")
            except Exception as exc:   # safetensors raises its own error types and OSError
                raise ModelLoadError(f"{path / name}: malformed safetensors: {exc}") from exc
            self._open[name] = handle
            for key in handle.keys():
                if weight_map is None or weight_map.get(key) == name:
                    self._where[key] = name
        self._used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float32 array."""
        if name not in self._where:
            raise ModelLoadError(f"{self._path}: missing tensor {name}")
        self._used.add(name)
        return self._open[self._where[name]].get_tensor(name).float().numpy()

    def check_all_used(self) -> None:
        """Refuse a checkpoint with weights this model would ignore (a feature not understood)."""
        left = sorted(n for n in set(self._where) - self._used if not n.endswith("rotary_emb.inv_freq"))
        if left:
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise ModelLoadError(f"{self._path}: {len(left)} tensors the model does not use: {shown}")
