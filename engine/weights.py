"""Loading decoder weights from a GGUF file (`engine.gguf_weights`) or a Hugging Face directory
(`engine.hf_weights`).

Both loaders return a `ModelConfig` and a `LlamaWeights` whose projections are already fused for
the model's forward pass: ``wqkv`` is ``[(num_heads + 2 * num_kv_heads) * head_dim, hidden]`` and
``w_gate_up`` is ``[2 * intermediate, hidden]`` (row-major, ``y = x @ W.T``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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


class TensorSource(ABC):
    """A checkpoint tensor not read yet: its shape is known, its values are copied on demand
    straight into the tensor that keeps them (`stack_rows`), so that no full intermediate copy
    (a float32 one, say) is ever made. ``shape`` is the logical shape, rows first."""

    shape: tuple[int, ...]

    @abstractmethod
    def copy_into(self, out: torch.Tensor) -> None:
        """Copy the values into ``out`` (same shape, any floating dtype: converted as
        ``Tensor.copy_`` converts). Raises ModelLoadError when the file cannot be read."""

    @abstractmethod
    def rows(self, start: int, stop: int) -> "TensorSource":
        """Rows ``start:stop`` (clipped to the row count, like a numpy slice) as a source."""


Dense = np.ndarray | torch.Tensor | TensorSource
"""A dense weight as the loaders hand it over: a numpy array (GGUF, dequantized), a torch tensor,
or a `TensorSource` (a safetensors entry, read when placed)."""


def stack_rows(parts: list[Dense], dtype: torch.dtype) -> torch.Tensor:
    """``parts`` stacked along dim 0 into one new tensor of ``dtype``: allocated once, each part
    converted straight into its rows (a bfloat16 part placed in bfloat16 is copied bit for bit,
    with no float32 intermediate).

    Args:
        parts: arrays, tensors or `TensorSource` of shapes ``[rows_i, *rest]`` with one ``rest``.
        dtype: the result's dtype (float32 or bfloat16).
    Returns:
        ``[sum(rows_i), *rest]`` tensor of ``dtype``, on the CPU, contiguous.
    Raises:
        ModelLoadError: the parts' trailing shapes differ.
    """
    shapes = [tuple(p.shape) for p in parts]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ModelLoadError(f"cannot stack weights of shapes {shapes}")
    out = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype)
    row = 0
    for part, shape in zip(parts, shapes):
        _copy_into(out[row:row + shape[0]], part)
        row += shape[0]
    return out


def _copy_into(out: torch.Tensor, part: Dense) -> None:
    if isinstance(part, TensorSource):
        part.copy_into(out)
    elif isinstance(part, np.ndarray):
        array = np.ascontiguousarray(part, dtype=np.float32)
        out.copy_(torch.from_numpy(array if array.flags.writeable else array.copy()))
    else:
        out.copy_(part)


def to_tensor(array: Dense, dtype: torch.dtype) -> torch.Tensor:
    """``array`` (numpy array, tensor or `TensorSource`) copied into a new tensor of ``dtype``:
    `stack_rows` of one part (a 0-d value is taken as is). Raises ModelLoadError as it does."""
    if len(array.shape) == 0:
        return torch.as_tensor(np.asarray(array, dtype=np.float32) if isinstance(array, np.ndarray)
                               else array).to(dtype=dtype, copy=True)
    return stack_rows([array], dtype)


def _projection(parts: list, dtype: torch.dtype) -> Projection:
    """Row-stack projections: 4-bit when every part is (and the rows pack into the int4 kernel's
    tiles of 16), else dense (a mixed layer dequantizes; `stack_rows`)."""
    if all(isinstance(p, Int4Weight) for p in parts) and sum(p.shape[0] for p in parts) % 16 == 0:
        return parts[0] if len(parts) == 1 else Int4Weight.cat(parts)
    return stack_rows([p.dequantize() if isinstance(p, Int4Weight) else p for p in parts], dtype)


def fuse_layer(cfg: ModelConfig, dtype: torch.dtype, **w) -> LayerWeights:
    """A layer's weights, Q/K/V and gate/up fused; without ``gate`` (an MoE layer) no dense MLP.
    Norms with `ModelConfig.norm_offset` stay float32 (the loader has added the offset)."""
    dense = "gate" in w
    norm_dtype = torch.float32 if cfg.norm_offset else dtype
    return LayerWeights(
        attn_norm=to_tensor(w["attn_norm"], norm_dtype),
        wqkv=_projection([w["q"], w["k"], w["v"]], dtype),
        wo=_projection([w["o"]], dtype),
        ffn_norm=to_tensor(w["ffn_norm"], norm_dtype),
        w_gate_up=_projection([w["gate"], w["up"]], dtype) if dense else None,
        w_down=_projection([w["down"]], dtype) if dense else None,
    )


def check_shapes(cfg: ModelConfig, w: LlamaWeights, path: Path) -> None:
    """Check the embedding, head, layer 0's projections, biases and Q/K norms, and the first
    dense layer's MLP against ``cfg``.

    Raises:
        ModelLoadError: a shape that differs, naming the tensor, its shape and the expected one.
    """
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


