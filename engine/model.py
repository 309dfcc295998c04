"""Llama-family decoder in plain torch, reading and writing K/V through a paged pool.

RMSNorm, rotary embeddings with the file's theta ("rotate half" convention), grouped-query
attention, SwiGLU MLP, tied embeddings when the file has no output weight. Fused Q/K/V and
gate/up projections (see `engine.weights`). Reference: Hugging Face ``modeling_llama.py``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from engine.attention import ForwardBatch, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import KVPool
from engine.linear import Linear, bf16_matmul_fast, resolve_backend
from engine.quant import HeadLinear, Int4Linear, Int4Weight
from engine.weights import LlamaWeights

LayerCallback = Callable[[int], None]


class LlamaModel:
    """Forward pass over a `ForwardBatch`.

    The model holds no per-request state: K/V live in the `KVPool` passed to `forward`.
    """

    def __init__(self, config: ModelConfig, weights: LlamaWeights, linear_backend: str = "auto",
                 max_int4_rows: int = 4, max_int8_head_rows: int = 4, kv_dtype: torch.dtype | None = None,
                 gemv_copies: bool = True):
        """Args:
            linear_backend: "auto", "onednn" or "torch" (see `engine.linear`).
            max_int4_rows: 4-bit projections (`engine.quant`) use the int4 kernel for at most this
                many tokens per forward pass, their dequantized bfloat16 copy above it.
            max_int8_head_rows: with 4-bit projections, the LM head runs int8 for at most this
                many logits rows, a dense copy above it (`engine.quant.HeadLinear`).
            gemv_copies: float32 projections keep their plain weights beside oneDNN's packed ones
                for one-row inputs (`engine.linear.Linear`; more memory, faster batch-1 decode).
            kv_dtype: dtype of the KV pool (default: the weights'; `engine.config.KV_CACHE_DTYPES`).
                K/V are stored in it; attention runs in it too where the CPU computes bfloat16
                natively (`engine.linear.bf16_matmul_fast`), else in the activations' dtype on
                the stored K/V cast up (torch's bfloat16 attention is ~3x slower than float32
                without AVX512-BF16), its output cast back either way.
        Raises:
            ValueError: unknown or unusable linear backend; 4-bit projections on a non-CPU device.
        """
        self.config = config
        self.dtype = weights.embed.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.attn_dtype = (self.kv_dtype if self.kv_dtype == self.dtype or self.device_native_bf16(weights)
                           else self.dtype)
        self._embed = weights.embed
        self._final_norm = weights.final_norm
        self._norms = [(layer.attn_norm, layer.ffn_norm) for layer in weights.layers]
        backend = resolve_backend(linear_backend, weights.embed.device)
        self.linear_backend = backend
        self.quantized = any(isinstance(p, Int4Weight) for layer in weights.layers
                             for p in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        if self.quantized and weights.embed.device.type != "cpu":
            raise ValueError("4-bit (native) weights run on the CPU only")
        self._layers = [_LayerLinears(layer, backend, max_int4_rows, gemv_copies) for layer in weights.layers]
        self._lm_head = (HeadLinear(weights.lm_head, max_int8_head_rows, backend) if self.quantized
                         else Linear(weights.lm_head, backend, gemv_copies))
        self.device = weights.embed.device
        self._cos, self._sin = (t.to(self.device) for t in _rope_tables(config, self.dtype))
        c = config
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool,
                on_layer_done: LayerCallback | None = None) -> torch.Tensor:
        """Compute the new tokens' K/V into ``pool`` and the logits of ``batch.logits_indices``.

        Args:
            on_layer_done: called with the layer index once that layer's K/V are in the pool
                (a prefill worker posts that layer's KV writes from it).
        Returns:
            ``[len(batch.logits_indices), vocab_size]`` float32 logits.
        Raises:
            ValueError: the pool's dtype is not the model's ``kv_dtype``.
        """
        c = self.config
        if pool.kv.dtype != self.kv_dtype:
            raise ValueError(f"KV pool dtype {pool.kv.dtype} differs from the model's {self.kv_dtype}")
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        h = self._embed.index_select(0, batch.input_ids)
        cos = self._cos.index_select(0, batch.positions)[:, None, :]
        sin = self._sin.index_select(0, batch.positions)[:, None, :]
        t = h.shape[0]
        kv_cast, q_cast = self.kv_dtype != self.dtype, self.attn_dtype != self.dtype
        for i, ((attn_norm, ffn_norm), lin) in enumerate(zip(self._norms, self._layers)):
            x = _rms_norm(h, (c.hidden_size,), attn_norm, c.rms_norm_eps)
            qkv = lin.wqkv(x)
            q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
            q = _rotate(q.view(t, c.num_heads, c.head_dim), cos, sin)
            k = _rotate(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.view(t, c.num_kv_heads, c.head_dim)
            if kv_cast:   # attention on the K/V as stored (paged_attention casts them to q's dtype)
                k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
            if q_cast:
                q = q.to(self.attn_dtype)
            k_pool, v_pool = pool.layer_view(i)
            k_pool.index_copy_(0, batch.slot_mapping, k)
            v_pool.index_copy_(0, batch.slot_mapping, v)
            attn = paged_attention(q, k, v, k_pool, v_pool, batch, pool.block_size)
            if q_cast:
                attn = attn.to(self.dtype)
            h = h + lin.wo(attn)
            x = _rms_norm(h, (c.hidden_size,), ffn_norm, c.rms_norm_eps)
            gate, up = lin.w_gate_up(x).chunk(2, dim=-1)
            h = h + lin.w_down(F.silu(gate) * up)
            if on_layer_done is not None:
                on_layer_done(i)
        h = _rms_norm(h.index_select(0, batch.logits_indices), (c.hidden_size,),
                       self._final_norm, c.rms_norm_eps)
        return self._lm_head(h).float()


    @staticmethod
    def device_native_bf16(weights) -> bool:
        """True for a CUDA model, or a CPU whose oneDNN multiplies bfloat16 natively."""
        return weights.embed.device.type != "cpu" or bf16_matmul_fast()


class _LayerLinears:
    def __init__(self, layer, backend: str, max_int4_rows: int, gemv_copies: bool):
        def make(w):
            return (Int4Linear(w, max_int4_rows, backend) if isinstance(w, Int4Weight)
                    else Linear(w, backend, gemv_copies))

        self.wqkv = make(layer.wqkv)
        self.wo = make(layer.wo)
        self.w_gate_up = make(layer.w_gate_up)
        self.w_down = make(layer.w_down)


def _rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. Float32 input: ``F.rms_norm``. Lower precision (bfloat16):
    normalized in float32, cast back, then scaled by the weight, as Hugging Face's
    ``LlamaRMSNorm`` does; ``F.rms_norm`` on bfloat16 loses enough that SmolLM2-135M's greedy
    answers change ("What is the capital of France?" stops answering Paris)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_tables(c: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
    freqs = torch.outer(torch.arange(c.max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
