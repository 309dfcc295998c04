"""Weights and config from a Hugging Face directory: ``config.json`` (`engine.models.hf_config`)
and its safetensors files, one shard index or none.

Each tensor stays in the file, in the checkpoint's dtype, until it is placed: `_SafetensorsDir`
hands out `_Entry` sources, and `engine.weights.stack_rows` allocates each final tensor once
(Q/K/V and gate/up fused) and copies every source straight into its rows, converting then (a
bfloat16 checkpoint placed in bfloat16 is copied bit for bit; float32 mode converts one tensor at
a time). A source is read through ``safetensors.safe_open`` (memory-mapped) in slices of at most
`CHUNK_BYTES`, each mapping dropped once its slice is copied: the file pages a load keeps
resident are one slice's, whatever the shard size, so a load's peak memory is the placed weights
plus one slice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.hf_config import model_config_from_hf
from engine.models.moe import ExpertWeights
from engine.weights import LlamaWeights, TensorSource, check_shapes, fuse_layer, stack_rows, to_tensor

CHUNK_BYTES = 64 << 20
"""The most bytes of a stored tensor mapped at once while it is copied (`_Entry.copy_into`)."""
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _hf_qkv(cfg: ModelConfig, take, prefix: str) -> dict:
    """A layer's Q, K and V weights; Phi-3 stores them stacked in one ``qkv_proj``."""
    a = prefix + "self_attn."
    if cfg.architecture != "phi3":
        return {x: take(f"{a}{x}_proj.weight") for x in "qkv"}
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = take(a + "qkv_proj.weight")
    q, k, v = qkv.rows(0, q_rows), qkv.rows(q_rows, q_rows + kv_rows), qkv.rows(q_rows + kv_rows, qkv.shape[0])
    return {"q": q, "k": k, "v": v}   # a wrong row count shows as a wrong wqkv (`check_shapes`)


def _hf_mlp(cfg: ModelConfig, take, prefix: str) -> dict:
    """A dense layer's gate, up and down weights; Phi-3 stacks gate and up in ``gate_up_proj``."""
    m = prefix + "mlp."
    if cfg.architecture != "phi3":
        return {x: take(f"{m}{x}_proj.weight") for x in ("gate", "up", "down")}
    gate_up = take(m + "gate_up_proj.weight")
    half = gate_up.shape[0] // 2
    if gate_up.shape[0] % 2:
        raise ModelLoadError(f"{m}gate_up_proj.weight: {gate_up.shape[0]} rows do not split into gate and up")
    gate, up = gate_up.rows(0, half), gate_up.rows(half, 2 * half)
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
        gate_up.append(stack_rows([g, u], dtype))
        down.append(to_tensor(d, dtype))
    router = to_tensor(take(block + "gate.weight"), dtype)
    want = (cfg.num_experts, cfg.hidden_size)
    if tuple(router.shape) != want or tuple(gate_up[0].shape) != (2 * cfg.moe_intermediate_size, cfg.hidden_size):
        raise ModelLoadError(f"{block}: router {tuple(router.shape)} / expert gate+up {tuple(gate_up[0].shape)} do "
                             f"not fit {cfg.num_experts} experts of width {cfg.moe_intermediate_size}")
    return ExpertWeights(router=router, gate_up=gate_up, down=down)


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, LlamaWeights]:
    """A Hugging Face directory: ``config.json`` (`engine.models.hf_config`) and its safetensors,
    each tensor read from its memory-mapped file when it is placed, in the checkpoint's dtype
    until then (module docstring).

    Args:
        path: the directory.
        dtype: the placed tensors' dtype (float32 or bfloat16).
    Returns:
        The config and the weights (shapes: `engine.weights`), every tensor of ``dtype``.
    Raises:
        ModelLoadError: no or malformed config.json, index or safetensors file; a shard the index
            lists is missing; a tensor missing, of the wrong shape or of a dtype other than
            BF16/F16/F32/F64; tensors the model would not use; a tied head that differs.
    """
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
            cfg, dtype, attn_norm=norm(p + "input_layernorm.weight"), **_hf_qkv(cfg, take, p),
            o=take(p + "self_attn.o_proj.weight"), ffn_norm=norm(p + f"{ffn_norm}.weight"), **mlp,
        )
        if cfg.sandwich_norms:
            layer.post_attn_norm = norm(p + "post_attention_layernorm.weight")
            layer.post_ffn_norm = norm(p + "post_feedforward_layernorm.weight")
        if moe:
            layer.experts = _hf_experts(cfg, take, p, dtype)
        if cfg.qkv_bias:
            layer.bqkv = stack_rows([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"], dtype)
        if cfg.o_bias:
            layer.bo = to_tensor(take(p + "self_attn.o_proj.bias"), dtype)
        if cfg.qk_norm:
            layer.q_norm = norm(p + "self_attn.q_norm.weight")
            layer.k_norm = norm(p + "self_attn.k_norm.weight")
        layers.append(layer)
    embed = to_tensor(take("model.embed_tokens.weight"), dtype)
    if cfg.tie_word_embeddings:
        lm_head = embed
        if "lm_head.weight" in files and not take("lm_head.weight").equals(take("model.embed_tokens.weight")):
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


@dataclass(frozen=True)
class _Entry(TensorSource):
    """Rows ``start:start + shape[0]`` of tensor ``name`` in safetensors file ``file``, stored as
    ``dtype`` (None: a dtype the engine does not convert)."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    start: int = 0

    def rows(self, start: int, stop: int) -> "_Entry":
        n = self.shape[0]
        start = min(max(start, 0), n)
        stop = min(max(stop, start), n)
        return replace(self, shape=(stop - start, *self.shape[1:]), start=self.start + start)

    def copy_into(self, out: torch.Tensor) -> None:
        if self.dtype is None:
            raise ModelLoadError(f"{self.file}: {self.name} has a dtype the engine does not load")
        if tuple(out.shape) != self.shape:
            raise ModelLoadError(f"{self.file}: {self.name} rows of shape {self.shape} do not fit {tuple(out.shape)}")
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        step = max(1, CHUNK_BYTES // max(1, row_bytes))
        for a in range(0, self.shape[0], step):
            b = min(a + step, self.shape[0])
            with _safe_open(self.file) as handle:   # mapped for this slice only
                out[a:b].copy_(handle.get_slice(self.name)[self.start + a:self.start + b])

    def equals(self, other: "_Entry") -> bool:
        """Same shape and values (compared a slice at a time, in float32, which holds every
        BF16/F16/F32 value exactly)."""
        if self.shape != other.shape:
            return False
        step = max(1, CHUNK_BYTES // max(1, 4 * math.prod(self.shape[1:])))
        for a in range(0, self.shape[0], step):
            b = min(a + step, self.shape[0])
            if not torch.equal(to_tensor(self.rows(a, b), torch.float32), to_tensor(other.rows(a, b), torch.float32)):
                return False
        return True


def _safe_open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:   # safetensors raises its own error types and OSError
        raise ModelLoadError(f"{file}: malformed safetensors: {exc}") from exc


class _SafetensorsDir:
    """The tensors of a directory's safetensors files, by name, each read when placed.

    The file of each name comes from ``model.safetensors.index.json`` (``weight_map``) when it
    exists (a tensor also stored in another file is taken from the one the index names), else
    from every ``*.safetensors`` file's header. Only the headers are read here; `take` returns an
    `_Entry` that reads the values through a memory map when it is placed.

    Raises:
        ModelLoadError: no safetensors file, a malformed file or index, a shard the index lists
            missing, a tensor the index places in a file that lacks it, a missing tensor
            (`take`), or (`check_all_used`) tensors the model does not use.
    """

    def __init__(self, path: Path):
        self._path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ModelLoadError(f"{index}: malformed index: {exc}") from exc
            for name in files:
                if not (path / name).is_file():
                    raise ModelLoadError(f"{index}: shard {name} is missing from {path}")
        else:
            files, weight_map = [f.name for f in sorted(path.glob("*.safetensors"))], None
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors files")
        self._entries: dict[str, _Entry] = {}
        for name in files:
            with _safe_open(path / name) as handle:
                for key in handle.keys():
                    if weight_map is None or weight_map.get(key) == name:
                        info = handle.get_slice(key)
                        self._entries[key] = _Entry(path / name, key, tuple(info.get_shape()),
                                                    _DTYPES.get(info.get_dtype()))
        if weight_map is not None:
            absent = sorted(k for k in weight_map if k not in self._entries)
            if absent:
                raise ModelLoadError(f"{index}: {len(absent)} tensors are not in the shard the index names, "
                                     f"e.g. {absent[0]} in {weight_map[absent[0]]}")
        self._used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def take(self, name: str) -> _Entry:
        """Tensor ``name``, not read yet: an `engine.weights.TensorSource` (`_Entry`)."""
        if name not in self._entries:
            raise ModelLoadError(f"{self._path}: missing tensor {name}")
        self._used.add(name)
        return self._entries[name]

    def check_all_used(self) -> None:
        """Refuse a checkpoint with weights this model would ignore (a feature not understood)."""
        left = sorted(n for n in set(self._entries) - self._used if not n.endswith("rotary_emb.inv_freq"))
        if left:
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise ModelLoadError(f"{self._path}: {len(left)} tensors the model does not use: {shown}")
