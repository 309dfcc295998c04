"""Loading decoder weights from a GGUF file (`engine.gguf_weights`) or a Hugging Face directory
(`engine.hf_weights`).

Both loaders return a `ModelConfig` and a `LlamaWeights` whose projections are already fused for
the model's forward pass: ``wqkv`` is ``[(num_heads + 2 * num_kv_heads) * head_dim, hidden]`` and
``w_gate_up`` is ``[2 * intermediate, hidden]`` (row-major, ``y = x @ W.T``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.moe import ExpertWeights
from engine.quant import Int4Weight

Projection = torch.Tensor | Int4Weight


@dataclass
class LayerWeights:
    """One decoder block. Shapes: see module docstring; norms are ``[hidden]``. A projection is a
    dense tensor, or an `Int4Weight` of the same logical shape when loaded natively. Present only
    when the config asks for them: ``bqkv`` ``[(num_heads + 2 * num_kv_heads) * head_dim]``, ``bo``
    ``[hidden]``, ``q_norm`` / ``k_norm`` ``[head_dim]``, ``post_attn_norm`` / ``post_ffn_norm``
    ``[hidden]`` (`ModelConfig.sandwich_norms`); norms with `ModelConfig.norm_offset` already
    include it and stay float32 whatever the dtype; in a layer of `ModelConfig.moe_layers`,
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
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    experts: ExpertWeights | None = None


@dataclass
class LlamaWeights:
    """All weights. ``embed`` is ``[vocab, hidden]``; ``lm_head`` is ``embed`` itself when tied."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``array`` copied into a new tensor of ``dtype`` (through float32)."""
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(dtype)


def _projection(parts: list, dtype: torch.dtype) -> Projection:
    """Row-stack projections: 4-bit when every part is (and the rows pack into the int4 kernel's
    tiles of 16), else dense (a mixed layer dequantizes)."""
    if all(isinstance(p, Int4Weight) for p in parts) and sum(p.shape[0] for p in parts) % 16 == 0:
        return parts[0] if len(parts) == 1 else Int4Weight.cat(parts)
    dense = [p.dequantize().numpy() if isinstance(p, Int4Weight) else p for p in parts]
    return to_tensor(np.concatenate(dense, axis=0), dtype)


def fuse_layer(cfg: ModelConfig, dtype: torch.dtype, **w) -> LayerWeights:
    """A layer's weights, Q/K/V and gate/up fused; without ``gate`` (an MoE layer) no dense MLP."""
    dense = "gate" in w
    return LayerWeights(
        attn_norm=to_tensor(w["attn_norm"], dtype),
        wqkv=_projection([w["q"], w["k"], w["v"]], dtype),
        wo=_projection([w["o"]], dtype),
        ffn_norm=to_tensor(w["ffn_norm"], dtype),
        w_gate_up=_projection([w["gate"], w["up"]], dtype) if dense else None,
        w_down=_projection([w["down"]], dtype) if dense else None,
    )


def check_shapes(cfg: ModelConfig, w: LlamaWeights, path: Path) -> None:
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


