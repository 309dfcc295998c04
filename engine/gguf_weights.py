"""Weights and config from a GGUF file written by llama.cpp's converter.

Architectures (``general.architecture``; config: `engine.models.gguf_config`, whose
`~engine.models.gguf_config.FAMILIES` table says what each implies): ``llama`` (Llama, Mistral and
Mixtral, which llama.cpp writes as llama), ``qwen2`` (Q/K/V biases), ``qwen3`` (``attn_q_norm`` /
``attn_k_norm``), ``qwen3moe`` (routed experts) and ``phi3`` (fused ``attn_qkv``; ``ffn_up``
holding gate then up; partial rotary), ``gemma2`` and ``gemma3`` (sandwich norms, ``+ 1`` norms).

Tensor layout (source: llama.cpp ``convert_hf_to_gguf.py``, now ``conversion/llama.py``,
``qwen.py``, ``phi.py``; names from gguf-py ``TENSOR_NAMES``): ``blk.N.attn_q/k/v/output``,
``attn_norm``, ``ffn_norm``, ``ffn_gate/up/down``; Gemma (``conversion/gemma.py``) adds
``post_attention_norm`` and ``post_ffw_norm`` (``ffn_norm`` is its pre-MLP norm), every norm
weight stored with the ``+ 1`` of Gemma's ``(1 + w)`` already added (kept as stored, in float32,
as the Hugging Face path computes them); MoE layers ``ffn_gate_inp`` (router) and
``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, the experts stacked into one 3-D tensor
(``[experts, rows, cols]`` as numpy reads it); ``token_embd``, ``output_norm``, ``output``
(absent when tied). For ``llama`` only, the converter permutes the rows of Q and K (and their
biases) so that llama.cpp's NORM rotary kernel can rotate adjacent pairs (``LlamaModel.permute``);
we undo it, so rotary here uses the Hugging Face "rotate half" convention. The NEOX-rope
families (qwen2, qwen3, qwen3moe, phi3) are written as Hugging Face stores them. A tensor the
model does not use (``rope_factors_long``: Phi-3 LongRoPE; anything else) is refused; Llama 3's
``rope_freqs`` is read into the config's llama3 scaling (`engine.models.gguf_config`).

Quantized tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, ...) are dequantized to float32
(`dequantize`), except with ``native=True``: then attention and dense MLP projections stored as
Q4_0 / Q4_1 / Q4_K stay 4-bit (`engine.quant.Int4Weight`, run by the int4 kernel); experts,
norms, embeddings and other types are dequantized.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.modelfile import gguf_reader
from engine.models.gguf_config import GGUFFamily, family_of, model_config_from_gguf
from engine.models.moe import ExpertWeights
from engine.quant import NATIVE_TYPES, Int4Weight, QuantFormatError
from engine.weights import LlamaWeights, check_shapes, fuse_layer, to_tensor

Array = np.ndarray | Int4Weight


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``LlamaModel.permute``). ``w`` is
    ``[n_heads * head_dim, ...]`` (a weight or a bias); returns the same shape."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rows(array: Array, start: int, stop: int) -> Array:
    if isinstance(array, Int4Weight):
        return array.take_rows(np.arange(start, stop))
    return array[start:stop]


class _GGUFTensors:
    """A GGUF file's tensors by name, decoded when taken.

    ``take(name, native=True)`` keeps a Q4_0 / Q4_1 / Q4_K matrix 4-bit when the loader runs
    natively; anything else is dequantized to float32 (`dequantize`, shape as numpy reads it:
    ``[..., rows, row_length]``).

    Raises:
        ModelLoadError: a missing tensor, one that cannot be decoded, or (`check_all_used`)
            tensors the model does not use.
    """

    def __init__(self, reader, path: Path, native: bool):
        self._tensors = {t.name: t for t in reader.tensors}
        self._path, self._native = path, native
        self._used: set[str] = set()
        self.int4 = 0

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, native: bool = False) -> Array:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self._path}: missing tensor {name}")
        self._used.add(name)
        kind = tensor.tensor_type.name
        try:
            if native and self._native and kind in NATIVE_TYPES and len(tensor.shape) == 2:
                k = int(tensor.shape[0])   # ggml's ne[0]: the row length (in_features)
                self.int4 += 1
                return Int4Weight.from_gguf(tensor.data, kind, (int(tensor.n_elements) // k, k))
            return dequantize(tensor.data, kind)
        except Exception as exc:
            raise ModelLoadError(f"{self._path}: cannot load {name} ({kind}): {exc}") from exc

    def check_all_used(self) -> None:
        """Refuse a file with tensors this model would ignore (a feature not understood)."""
        left = sorted(set(self._tensors) - self._used)
        if left:
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise ModelLoadError(f"{self._path}: {len(left)} tensors the model does not use: {shown}")


# ggml's blocks of 32 weights that torch decodes: type -> bytes per block (ggml-common.h)
_TORCH_BLOCKS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize(data: np.ndarray, kind: str) -> np.ndarray:
    """A GGUF tensor's raw bytes ``data`` (``gguf.ReaderTensor.data``: ``[..., rows,
    bytes_per_row]`` uint8 for a quantized type, else the values) of GGUF type ``kind`` ->
    float32 ``[..., rows, row_length]``.

    Q8_0, Q4_0 and Q4_1 (ggml-common.h ``block_q8_0`` ``{d, qs[32]}``, ``block_q4_0`` ``{d,
    qs[16]}``, ``block_q4_1`` ``{d, m, qs[16]}``; float16 ``d`` and ``m``, low nibbles the first
    16 weights) are decoded by torch on whole tensors: ``d * q``, ``d * (q - 8)``, ``d * q + m``
    in float32, the operations and order of gguf-py's ``dequantize_blocks``, so the values are
    bit for bit the ones `gguf.quants.dequantize` gives (a unit test compares them); other types
    go through `gguf.quants.dequantize`.

    Raises: NotImplementedError (gguf's) for a type gguf cannot decode, ValueError (gguf's) or
    QuantFormatError for bytes that are not whole blocks.
    """
    block_bytes = _TORCH_BLOCKS.get(kind)
    if block_bytes is None:
        import gguf
        return np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
    if data.dtype != np.uint8 or data.shape[-1] % block_bytes:
        raise QuantFormatError(f"{kind} rows of {data.shape[-1]} {data.dtype} are not whole "
                               f"{block_bytes}-byte blocks")
    # a copy: the file's bytes are a read-only map, which torch.from_numpy would warn of
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, block_bytes)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        w = d * blocks[:, 2:].contiguous().view(torch.int8).float()
    else:
        qs = blocks[:, block_bytes - 16:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        if kind == "Q4_0":
            w = d * (q.to(torch.int8) - 8).float()
        else:
            w = d * q.float() + blocks[:, 2:4].contiguous().view(torch.float16).float()
    return w.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * 32).numpy()


def _qkv(cfg: ModelConfig, fam: GGUFFamily, t: _GGUFTensors, p: str) -> dict:
    """A layer's Q, K, V (rows unpermuted for llama; Phi-3's ``attn_qkv`` split)."""
    if fam.fused:
        qkv = t.take(p + "attn_qkv.weight", native=True)
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # a wrong row count shows as a wrong wqkv (`check_shapes`)
        return {"q": _rows(qkv, 0, q_rows), "k": _rows(qkv, q_rows, q_rows + kv_rows),
                "v": _rows(qkv, q_rows + kv_rows, qkv.shape[0])}
    w = {x: t.take(f"{p}attn_{x}.weight", native=True) for x in "qkv"}
    if fam.permuted_qk:
        w["q"], w["k"] = _unpermute(w["q"], cfg.num_heads), _unpermute(w["k"], cfg.num_kv_heads)
    return w


def _unpermute(array: Array, heads: int) -> Array:
    if isinstance(array, Int4Weight):
        rows = np.arange(array.shape[0])
        return array.take_rows(unpermute_rotary_rows(rows, heads))
    return unpermute_rotary_rows(array, heads)


def _mlp(fam: GGUFFamily, t: _GGUFTensors, p: str) -> dict:
    """A dense layer's gate, up, down (Phi-3's ``ffn_up`` holds gate rows, then up rows)."""
    down = t.take(p + "ffn_down.weight", native=True)
    if fam.fused:
        up = t.take(p + "ffn_up.weight", native=True)
        half = up.shape[0] // 2
        return {"gate": _rows(up, 0, half), "up": _rows(up, half, up.shape[0]), "down": down}
    return {"gate": t.take(p + "ffn_gate.weight", native=True), "up": t.take(p + "ffn_up.weight", native=True),
            "down": down}


def _experts(cfg: ModelConfig, t: _GGUFTensors, p: str, dtype: torch.dtype) -> ExpertWeights:
    """A MoE layer: router ``ffn_gate_inp`` ``[experts, hidden]``, ``ffn_gate_exps`` /
    ``ffn_up_exps`` ``[experts, moe_intermediate, hidden]``, ``ffn_down_exps``
    ``[experts, hidden, moe_intermediate]`` (numpy order; ggml's ``ne`` reversed)."""
    router = to_tensor(t.take(p + "ffn_gate_inp.weight"), dtype)
    gate, up, down = (t.take(f"{p}ffn_{x}_exps.weight") for x in ("gate", "up", "down"))
    e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes = (tuple(router.shape), gate.shape, up.shape, down.shape)
    if shapes != ((e, h), (e, f, h), (e, f, h), (e, h, f)):
        raise ModelLoadError(f"{p}ffn_*: router / gate / up / down shapes {shapes} do not fit {e} experts "
                             f"of width {f} over hidden {h}")
    return ExpertWeights(router=router, gate_up=[to_tensor(np.concatenate([gate[i], up[i]]), dtype) for i in range(e)],
                         down=[to_tensor(down[i], dtype) for i in range(e)])


def _bias_qkv(cfg: ModelConfig, fam: GGUFFamily, t: _GGUFTensors, p: str) -> np.ndarray:
    q, k, v = (t.take(f"{p}attn_{x}.bias") for x in "qkv")
    if fam.permuted_qk:   # the converter permutes q_proj.bias / k_proj.bias too
        q, k = unpermute_rotary_rows(q, cfg.num_heads), unpermute_rotary_rows(k, cfg.num_kv_heads)
    return np.concatenate([q, k, v])


def load_gguf(path: Path, dtype: torch.dtype, native: bool = False) -> tuple[ModelConfig, LlamaWeights]:
    """Config and weights of a GGUF file (module docstring).

    Args:
        dtype: dtype of every dense tensor (float32 or bfloat16).
        native: keep Q4_0 / Q4_1 / Q4_K projections 4-bit (`engine.quant.Int4Weight`).
    Raises:
        ModelLoadError: an unsupported architecture or metadata value
            (`engine.models.gguf_config.model_config_from_gguf`), a missing, undecodable,
            misshapen or unused tensor, or ``native`` for a file with no 4-bit projection.
    """
    reader = gguf_reader(path)
    _, fam = family_of(reader, path)
    cfg = model_config_from_gguf(reader, path)
    t = _GGUFTensors(reader, path, native)
    if "rope_freqs.weight" in t:   # Llama 3's scaling, read into cfg.rope_scaling (gguf_config._llama3)
        t.take("rope_freqs.weight")
    def norm(name: str) -> torch.Tensor:
        """A norm weight; Gemma's (``+ 1`` already stored by the converter) kept in float32."""
        return to_tensor(t.take(name), torch.float32 if cfg.norm_offset else dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        moe = i in cfg.moe_layers
        layer = fuse_layer(cfg, dtype, attn_norm=t.take(p + "attn_norm.weight"), **_qkv(cfg, fam, t, p),
                           o=t.take(p + "attn_output.weight", native=True), ffn_norm=t.take(p + "ffn_norm.weight"),
                           **({} if moe else _mlp(fam, t, p)))
        if cfg.sandwich_norms:
            layer.post_attn_norm = norm(p + "post_attention_norm.weight")
            layer.post_ffn_norm = norm(p + "post_ffw_norm.weight")
        if moe:
            layer.experts = _experts(cfg, t, p, dtype)
        if cfg.qkv_bias:
            layer.bqkv = to_tensor(_bias_qkv(cfg, fam, t, p), dtype)
        if cfg.o_bias:
            layer.bo = to_tensor(t.take(p + "attn_output.bias"), dtype)
        if cfg.qk_norm:
            layer.q_norm, layer.k_norm = norm(p + "attn_q_norm.weight"), norm(p + "attn_k_norm.weight")
        layers.append(layer)
    if native and not t.int4:
        raise ModelLoadError(f"{path}: native weights need Q4_0/Q4_1/Q4_K projections; this file has none "
                             "(use fp32 or bf16)")
    embed = to_tensor(t.take("token_embd.weight"), dtype)
    lm_head = embed if cfg.tie_word_embeddings else to_tensor(t.take("output.weight"), dtype)
    weights = LlamaWeights(embed=embed, layers=layers,
                           final_norm=norm("output_norm.weight"), lm_head=lm_head)
    check_shapes(cfg, weights, path)
    t.check_all_used()
    return cfg, weights
