"""Configuration of the model (read from the weights file) and of the engine (chosen by the user)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --weights: how the model's weights are held -> the dtype of activations, and of the KV pool.
# fp32: the reference (greedy == transformers); bf16: every tensor bfloat16; native: the GGUF's
# 4-bit projections run as stored (engine.quant, bfloat16 matmul inputs), norms, rotary and the
# residual stream float32 as in fp32 mode, K/V stored and attended in bfloat16 (llama.cpp's
# default KV cache is float16 for the same reason: a decode step reads every cached K/V; bfloat16
# rather than float16 because torch's CPU attention kernel is faster in it; measured:
# docs/PERFORMANCE.md, "Attention dtype on the CPU").
WEIGHT_MODES = {"fp32": "float32", "bf16": "bfloat16", "native": "float32"}
KV_CACHE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "native": "bfloat16"}
WEIGHT_CHOICES = ("auto", *WEIGHT_MODES)
"""What ``--weights`` takes: a mode of `WEIGHT_MODES`, or "auto", resolved when the model loads
(`engine.loader.resolve_weights`: the checkpoint's own format where this machine runs it natively)."""


def weights_dtype(weights: str) -> str:
    """The activation dtype of a ``--weights`` mode. Raises ValueError for another mode."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {sorted(WEIGHT_MODES)}, got {weights!r}")
    return WEIGHT_MODES[weights]


def kv_cache_dtype(weights: str) -> str:
    """The KV pool dtype of a ``--weights`` mode. Raises ValueError for another mode."""
    weights_dtype(weights)
    return KV_CACHE_DTYPES[weights]


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
"""Rotary scalings the engine implements (Hugging Face ``rope_type`` names; formulas in
`engine.models.rope`)."""


@dataclass(frozen=True)
class RopeScaling:
    """A rotary-embedding scaling, as a checkpoint's ``rope_parameters`` / ``rope_scaling`` gives it
    (names and defaults: Hugging Face ``modeling_rope_utils.py``).

    Fields:
        rope_type: one of `ROPE_TYPES` other than "default".
        factor: context extension factor (linear: positions divided by it; longrope: the
            checkpoint's ``factor``, else ``max_position_embeddings / original``).
        original_max_position: the pre-training context, tokens (llama3, yarn, longrope; dynamic:
            ``max_position_embeddings``, the length past which it rescales).
        low_freq_factor, high_freq_factor: llama3's wavelength bounds.
        beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate: YaRN's
            (attention_factor None: derived from ``factor`` and the mscales; longrope's from
            ``factor`` and ``original_max_position``).
        short_factor, long_factor: longrope's per-frequency divisors (``rotary_dim // 2`` each,
            checked by `ModelConfig`), for sequences up to / past ``original_max_position``.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES or self.rope_type == "default":
            raise ModelLoadError(f"rope_type {self.rope_type!r} is not supported; supported: "
                                 f"{', '.join(ROPE_TYPES)}")
        if not self.factor > 0:
            raise ModelLoadError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type in ("dynamic", "longrope") and not (self.original_max_position or 0) > 0:
            raise ModelLoadError(f"{self.rope_type} needs original_max_position_embeddings > 0, "
                                 f"got {self.original_max_position}")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                if values is None:
                    raise ModelLoadError(f"longrope needs {name} (a list of numbers)")
                if not all(v > 0 for v in values):
                    raise ModelLoadError(f"longrope {name} must be > 0 throughout, got {list(values)}")


HIDDEN_ACTS = ("silu", "gelu_tanh")
"""Gated-MLP activations the engine implements (`ModelConfig.hidden_act`)."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder, as stored in the weights file.

    Fields:
        name: human-readable model name (GGUF ``general.name`` or the directory name).
        vocab_size: number of token ids (rows of the embedding).
        hidden_size: model width (576 for SmolLM2-135M).
        intermediate_size: SwiGLU inner width.
        num_layers: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention when < num_heads).
        head_dim: per-head width; hidden_size // num_heads unless the file says otherwise.
        rope_theta: RoPE base frequency.
        rms_norm_eps: RMSNorm epsilon.
        max_position: context length the model was trained for, in tokens.
        tie_word_embeddings: the LM head reuses the token embedding.
        architecture: the family that runs it (`engine.models.registry`): a Hugging Face
            ``model_type`` or a GGUF ``general.architecture``.
        rope_scaling: None for plain rotary embeddings (``rope_type`` "default").
        sliding_window: a layer of ``window_layers`` attends to the last this many positions only
            (Hugging Face's ``kv_idx > q_idx - sliding_window``); None: every layer to the whole context.
        window_layers: the layers that attend through ``sliding_window`` (Gemma's and Qwen's
            ``layer_types`` "sliding_attention"); None: every layer (Mistral, Mixtral, Phi-3).
        local_rope_theta: RoPE base of the sliding layers when it differs from ``rope_theta``
            (Gemma 3's ``rope_local_base_freq``; those layers get no ``rope_scaling``); None: the same.
        rotary_dim: how many of each head's first dimensions rotate (Phi-3's
            ``partial_rotary_factor``; the rest pass through); 0: all ``head_dim``.
        qkv_bias: Q, K and V projections add a bias (Qwen2; Llama's ``attention_bias``).
        o_bias: the output projection adds a bias (Llama's ``attention_bias``).
        qk_norm: per-head RMSNorm of Q and K before the rotary embedding (Qwen3).
        num_experts: routed experts per MoE layer (0: a dense model; `engine.models.moe`).
        num_experts_per_tok: experts each token goes through (top-k).
        moe_intermediate_size: each expert's SwiGLU inner width.
        norm_topk_prob: the top-k routing weights are renormalized to sum to 1.
        moe_layers: indices of the layers whose MLP is the routed experts (the others dense).
        hidden_act: the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma's
            ``gelu_pytorch_tanh``).
        norm_offset: every RMSNorm scales by ``norm_offset + weight`` (Gemma: 1.0; the loaders
            add it to the stored weights, as llama.cpp's converter does).
        sandwich_norms: attention and MLP outputs are RMS-normed before the residual add
            (Gemma 2/3's ``post_attention_layernorm`` / ``post_feedforward_layernorm``).
        embedding_multiplier: the token embedding is scaled by it, in the weights' dtype (Gemma:
            ``sqrt(hidden_size)``); None: not scaled.
        attn_scale: attention scores' scale (Gemma: ``query_pre_attn_scalar ** -0.5``); None:
            ``head_dim ** -0.5``.
        attn_softcap: attention scores become ``cap * tanh(scores / cap)`` before the mask
            (Gemma 2's ``attn_logit_softcapping``); None: no capping.
        final_softcap: the logits become ``cap * tanh(logits / cap)`` (``final_logit_softcapping``).
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    architecture: str = "llama"
    rope_scaling: RopeScaling | None = None
    rotary_dim: int = 0
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    window_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_multiplier: float | None = None
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (tokens), None when it attends to the whole context."""
        if self.sliding_window is None or (self.window_layers is not None and layer not in self.window_layers):
            return None
        return self.sliding_window

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, field) < 1:
                raise ModelLoadError(f"model config: {field} must be >= 1, got {getattr(self, field)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"model config: sliding_window must be >= 1, got {self.sliding_window}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelLoadError(f"model config: hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}")
        for field in ("attn_softcap", "final_softcap", "attn_scale", "embedding_multiplier"):
            if getattr(self, field) is not None and not getattr(self, field) > 0:
                raise ModelLoadError(f"model config: {field} must be > 0, got {getattr(self, field)}")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ModelLoadError(f"model config: rotary_dim={self.rotary_dim} must be even and within "
                                 f"head_dim={self.head_dim}")
        s, half = self.rope_scaling, (self.rotary_dim or self.head_dim) // 2
        for name in ("short_factor", "long_factor"):
            values = getattr(s, name, None)
            if values is not None and len(values) != half:
                raise ModelLoadError(f"model config: rope {name} has {len(values)} values, rotary dimensions / 2 "
                                     f"= {half}")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"model config: num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"1..num_experts={self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}")


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV pool.

    Fields:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool; the pool holds ``num_blocks * block_size`` tokens.
        dtype: element type of the pool ("float32", "bfloat16", "float16").
    """

    block_size: int = 16
    num_blocks: int = 2048
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


PREFILL_ORDERS = ("hrrn", "fifo")
MIN_TIMED_PREFILL_TOKENS = 64
"""The fewest prompt tokens a step beside decoding sequences carries under
``max_prefill_seconds_while_decoding`` (where the decode rows alone take about that long, prompts
still advance)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of the generator.

    Fields:
        max_num_seqs: most sequences in the running decode batch.
        max_num_batched_tokens: most tokens computed in one step; longer prompts are prefilled
            in chunks of this size.
        max_prefill_tokens_while_decoding: while sequences decode, a step carries them plus at
            most this many prompt tokens (chunked prefill, as vLLM's V1 scheduler and Sarathi-Serve
            do), so a burst of prompts delays each decode step by one such chunk instead of
            stalling decode until every prompt is computed.
        max_prefill_seconds_while_decoding: > 0: while sequences decode, a step also carries at
            most the prompt tokens the generator's measured rate of passes with prompts
            (`engine.scheduling.RateMeter`, tokens/s, decode rows included) computes in this many
            seconds, and at least `MIN_TIMED_PREFILL_TOKENS`: such a step then takes about this
            long on any CPU, where a token budget alone holds decoding sequences up longer the
            slower the CPU (Sarathi-Serve, Agrawal et al., OSDI 2024, sizes its token budget from a
            time-between-tokens target the same way). 0: the token budget alone.
        prefix_caching: reuse the K/V of full blocks an earlier sequence computed for the same
            leading tokens (`engine.kv_cache`, "Prefix caching"); only the rest is computed.
        prefill_order: ``"hrrn"``: queued prompts by highest response ratio (a burst shortest
            first, none starved; `engine.scheduling`); ``"fifo"``: arrival order (vLLM's).
            Prompts already started (chunked, preempted, or prefilled elsewhere and waiting for
            a batch slot) go first either way, in queue order.
        prefill_batch_tokens: a pass's prompts after the first join only whole and only while
            the prompt tokens of the pass stay within this (the throughput knee,
            `engine.scheduling.PassBudget`); None: up to the step's budget (one pass takes as
            many prompts as fit).
        parallel_min_tokens: passes of fewer tokens run on one torch thread, longer ones on all
            the process's threads (`engine.runner.ModelRunner`); 0: every pass on all of them.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_while_decoding: int = 512
    max_prefill_seconds_while_decoding: float = 0.0
    prefix_caching: bool = False
    prefill_order: str = "hrrn"
    prefill_batch_tokens: int | None = None
    parallel_min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.parallel_min_tokens < 0:
            raise ValueError(f"parallel_min_tokens must be >= 0, got {self.parallel_min_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding < 1:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1, "
                             f"got {self.max_prefill_tokens_while_decoding}")
        if not self.max_prefill_seconds_while_decoding >= 0:
            raise ValueError("max_prefill_seconds_while_decoding must be >= 0 seconds, "
                             f"got {self.max_prefill_seconds_while_decoding}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 1:
            raise ValueError(f"prefill_batch_tokens must be >= 1 or None, got {self.prefill_batch_tokens}")


def compatibility_hash(model: ModelConfig, cache: CacheConfig, weights: str = "fp32") -> str:
    """Hash of everything two workers must agree on to exchange KV blocks.

    Covers the model hyper-parameters, the weights mode (``native`` and ``bf16`` weights give
    different K/V for the same tokens), the pool dtype, the block size and the pool layout
    ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`` (num_blocks excluded:
    pools may differ in size). Returns 16 hex characters.
    """
    payload = {
        "model": dataclasses.asdict(model),
        "weights": weights,
        "dtype": cache.dtype,
        "block_size": cache.block_size,
        "layout": "L,2,H,N,B,D",
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
