"""Weights and config from a Hugging Face directory: ``config.json`` (`engine.models.hf_config`)
and its safetensors files, one shard index or none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.hf_config import model_config_from_hf
from engine.models.moe import ExpertWeights
from engine.weights import LlamaWeights, check_shapes, fuse_layer, to_tensor


def _hf_qkv(cfg: ModelConfig, take, prefix: str) -> dict:
    """A layer's Q, K and V weights; Phi-3 stores them stacked in one ``qkv_proj``."""
    a = prefix + "self_attn."
    if cfg.architecture != "phi3":
        return {x: take(f"{a}{x}_proj.weight") for x in "qkv"}
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = np.split(take(a + "qkv_proj.weight"), [q_rows, q_rows + kv_rows])
    return {"q": q, "k": k, "v": v}   # a wrong row count shows as a wrong wqkv (`check_shapes`)


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
        gate_up.append(to_tensor(np.concatenate([g, u]), dtype))
        down.append(to_tensor(d, dtype))
    router = to_tensor(take(block + "gate.weight"), dtype)
    want = (cfg.num_experts, cfg.hidden_size)
    if tuple(router.shape) != want or tuple(gate_up[0].shape) != (2 * cfg.moe_intermediate_size, cfg.hidden_size):
        raise ModelLoadError(f"{block}: router {tuple(router.shape)} / expert gate+up {tuple(gate_up[0].shape)} do "
                             f"not fit {cfg.num_experts} experts of width {cfg.moe_intermediate_size}")
    return ExpertWeights(router=router, gate_up=gate_up, down=down)


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, LlamaWeights]:
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

    def norm(name: str) -> torch.Tensor:
        """A norm weight; Gemma's ``(1 + w)`` kept in float32, as transformers computes it."""
        if not cfg.norm_offset:
            return to_tensor(take(name), dtype)
        return to_tensor(take(name), torch.float32) + cfg.norm_offset

    # Gemma: post_attention_layernorm normalizes the attention output, pre_feedforward_layernorm the MLP input
    ffn_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        moe = i in cfg.moe_layers
        mlp = {} if moe else _hf_mlp(cfg, take, p)
        layer = fuse_layer(
            cfg, dtype, attn_norm=take(p + "input_layernorm.weight"), **_hf_qkv(cfg, take, p),
            o=take(p + "self_attn.o_proj.weight"), ffn_norm=take(p + f"{ffn_norm}.weight"), **mlp,
        )
        if cfg.norm_offset:
            layer.attn_norm, layer.ffn_norm = norm(p + "input_layernorm.weight"), norm(p + f"{ffn_norm}.weight")
        if cfg.sandwich_norms:
            layer.post_attn_norm = norm(p + "post_attention_layernorm.weight")
            layer.post_ffn_norm = norm(p + "post_feedforward_layernorm.weight")
        if moe:
            layer.experts = _hf_experts(cfg, take, p, dtype)
        if cfg.qkv_bias:
            layer.bqkv = to_tensor(np.concatenate([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]), dtype)
        if cfg.o_bias:
            layer.bo = to_tensor(take(p + "self_attn.o_proj.bias"), dtype)
        if cfg.qk_norm:
            layer.q_norm = norm(p + "self_attn.q_norm.weight")
            layer.k_norm = norm(p + "self_attn.k_norm.weight")
        layers.append(layer)
    embed = to_tensor(take("model.embed_tokens.weight"), dtype)
    if cfg.tie_word_embeddings:
        lm_head = embed
        if "lm_head.weight" in files and not np.array_equal(take("lm_head.weight"), take("model.embed_tokens.weight")):
            raise ModelLoadError(f"{path}: tie_word_embeddings=True but lm_head.weight differs from the embedding")
    elif "lm_head.weight" in files:
        lm_head = to_tensor(take("lm_head.weight"), dtype)
    else:
        raise ModelLoadError(f"{path}: tie_word_embeddings=False but the checkpoint has no lm_head.weight")
    weights = LlamaWeights(embed=embed, layers=layers,
                           final_norm=norm("model.norm.weight"), lm_head=lm_head)
    check_shapes(cfg, weights, path)
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
