"""Llama-family decoder in plain torch, reading and writing K/V through a paged pool.

RMSNorm, rotary embeddings with the file's theta and scaling ("rotate half" convention,
`engine.models.rope`), grouped-query attention, a gated MLP, tied embeddings when the file has no
output weight. Fused Q/K/V and gate/up projections (see `engine.weights`). The same network
with Q/K/V biases is Qwen2's, with per-head Q/K RMSNorm before the rotation Qwen3's; the config
says which (`ModelConfig.qkv_bias`, ``o_bias``, ``qk_norm``); with routed experts in place of
the MLP (`engine.models.moe`, `ModelConfig.moe_layers`) it is Mixtral's and Qwen3-MoE's. Gemma 2
and 3 are the same network with GeGLU, ``(1 + w)`` norms also after attention and MLP, a scaled
embedding, ``query_pre_attn_scalar``, soft-capping, sliding windows on some layers and (Gemma 3)
their own rope base (`ModelConfig.sandwich_norms` and the fields after it). References: Hugging
Face ``modeling_llama.py``, ``modeling_qwen2.py``, ``modeling_qwen3.py``, ``modeling_mixtral.py``,
``modeling_qwen3_moe.py``, ``modeling_gemma2.py``, ``modeling_gemma3.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial

import torch
import torch.nn.functional as F

from engine.attention import ForwardBatch, SeqChunk, paged_attention, store_kv
from engine.compiled import PassContext, compile_fn, register_kernel
from engine.config import ModelConfig
from engine.kv_cache import KVPool
from engine.linear import Linear, bf16_matmul_fast, gemv_copy_pays, resolve_backend
from engine.models.base import LayerCallback, LayerKV
from engine.models.moe import RoutedExperts
from engine.models.rope import RotaryEmbedding
from engine.quant import (LOW_BIT_KERNELS, HeadLinear, Int4Linear, Int4Weight, default_int8_head_rows,
                          measure_max_low_bit_rows)
from engine.tp import TPGroup, local_config, vocab_rows
from engine.tuning import tuned_low_bit_plans
from engine.weights import LayerWeights, LlamaWeights

log = logging.getLogger(__name__)


class LlamaModel:
    """Forward pass over a `ForwardBatch` (an `engine.models.base.CausalLM`). The model holds no
    per-request state: K/V live in the `KVPool` passed to `forward`. Building it takes the weights
    over: each layer's projections (and experts) are packed into the model's kernels and dropped
    from the `LlamaWeights` passed in (set to None, as is its ``lm_head``), one at a time, so that
    loading never holds a second full copy of the weights (each is large enough for a mapping of
    its own, so freeing it returns its pages at once). The caller must not use that weights object
    again; the model keeps the embedding, norms, biases, and float32 originals as gemv copies."""

    def __init__(self, config: ModelConfig, weights: LlamaWeights, linear_backend: str = "auto",
                 max_int4_rows: int | None = None, max_int8_head_rows: int | str | None = "default",
                 kv_dtype: torch.dtype | None = None,
                 gemv_copies: bool = True, compiled: bool = False, tp: TPGroup | None = None,
                 low_bit_threads: tuple[int, ...] | None = None):
        """Args:
            linear_backend: "auto", "onednn", "torch" or "template" (see `engine.linear`).
            max_int4_rows: 4-bit projections (`engine.quant.Int4Linear`) use a low-bit kernel for
                at most this many tokens per forward pass, their dequantized copy above it. None:
                timed on this CPU over every layer's projections, and so is which low-bit kernel,
                on each torch thread count a pass may run on, ``low_bit_threads`` (default: one
                and the load's), and kept for later loads (`engine.tuning`; `self.low_bit_plans`);
                given: torch's int4 kernel.
            max_int8_head_rows: with 4-bit projections, the LM head runs the file's Q8_0 blocks
                (int8 activations, `engine.mlas`) for at most this many logits rows, a dense
                copy above it (`engine.quant.HeadLinear`). "default": this CPU's
                (`engine.quant.default_int8_head_rows`). None: measured at load, as
                ``max_int4_rows``; not the default, since the two paths round the logits
                differently and a greedy answer whose two best tokens are that close must not
                depend on a timing (measured: docs/PERFORMANCE.md, "Q8_0 head on MatMulNBits").
            gemv_copies: float32 projections keep their plain weights beside oneDNN's packed ones
                for one-row inputs (`engine.linear.Linear`; more memory), if timing at load finds
                them faster on this CPU (`engine.linear.gemv_copy_pays`; `self.gemv_copies`).
            kv_dtype: dtype of the KV pool (default: the weights'; `engine.config.KV_CACHE_DTYPES`).
                K/V are stored in it; on CUDA attention runs in it too, on the CPU in float32
                on the gathered K/V cast up (bf16 mode: q cast up, the output back down), more
                accurate and faster: torch's CPU flash attention is slower in bfloat16 than in
                float32 (cast included), with AVX512-BF16 and without it alike (measured:
                docs/PERFORMANCE.md, "Attention dtype on the CPU").
            tp: this process's rank of a tensor-parallel group (`engine.tp`), ``weights`` being
                that rank's shard (`engine.tp.shard_weights`): the pass computes the rank's heads
                and MLP slice, all-reduces the row-parallel outputs and gathers the logits on
                rank 0 (the other ranks return their own columns). None: the whole model.
        Raises:
            ValueError: unknown or unusable linear backend; 4-bit projections on a non-CPU device;
                compiled layers with a TP size above 1 (not built yet).
        """
        self.config = config
        self.tp = tp or TPGroup(0, 1)
        if compiled and self.tp.size > 1:
            raise ValueError("compiled layers do not run tensor-parallel yet; use --enforce-eager")
        # the shapes this rank computes (its heads, its MLP slice); ``config`` stays the model's
        self._local = local_config(config, self.tp.size)
        self._vocab_first, self._vocab_count = vocab_rows(config.vocab_size, self.tp.rank, self.tp.size)
        self._vocab_width = -(-config.vocab_size // self.tp.size)
        self.dtype = weights.embed.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.attn_dtype = self.kv_dtype if weights.embed.device.type != "cpu" else torch.float32
        self._embed = weights.embed
        self._final_norm = weights.final_norm
        self._norms = [(layer.attn_norm, layer.ffn_norm) for layer in weights.layers]
        self._post_norms = [(layer.post_attn_norm, layer.post_ffn_norm) for layer in weights.layers]
        self._windows = [config.layer_window(i) for i in range(config.num_layers)]
        self._act = F.silu if config.hidden_act == "silu" else partial(F.gelu, approximate="tanh")
        self._extras = [_LayerExtras(layer, self._local) for layer in weights.layers]
        self.linear_backend = backend = resolve_backend(linear_backend, weights.embed.device)
        rest = "onednn" if backend == "template" else backend   # template: layer projections only, not head or experts
        self.quantized = any(isinstance(p, Int4Weight) for layer in weights.layers
                             for p in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        if self.quantized and weights.embed.device.type != "cpu":
            raise ValueError("4-bit (native) weights run on the CPU only")
        if (self.quantized and self.tp.size == 1 and bf16_matmul_fast()
                and all(layer.experts is None for layer in weights.layers)):
            self._bf16_activations()
        # the head before the layers: built after them, some processes ran the int4 projections
        # slower for their whole life, none with this order (the placement of the packed int4
        # weights beside onnxruntime's allocations, presumably; measured: docs/PERFORMANCE.md,
        # "Head build order")
        if max_int8_head_rows == "default":
            max_int8_head_rows = default_int8_head_rows()
        self._lm_head = (HeadLinear(weights.lm_head, max_int8_head_rows or 0, rest) if self.quantized
                         else Linear(weights.lm_head, rest, gemv_copies))
        weights.lm_head = None   # a tied head's weight stays referenced as the embedding
        self._layers, self._experts = [], []
        self.gemv_copies = False
        self.low_bit_kernel, self.low_bit_plans = None, {}   # few rows of the 4-bit projections (`_choose_low_bit_rows`)
        self._low_bit_threads = tuple(low_bit_threads or {1, torch.get_num_threads()})
        for i, layer in enumerate(weights.layers):
            self._layers.append(_LayerLinears(layer, backend, max_int4_rows or 0, gemv_copies,
                                              LOW_BIT_KERNELS if max_int4_rows is None else ("int4",)))
            self._experts.append(None if layer.experts is None else RoutedExperts(
                layer.experts, config.num_experts_per_tok, config.norm_topk_prob, rest))
            layer.experts = None
            if i == 0:   # decided on layer 0 and the head, so that the other layers make no unused copies
                self.gemv_copies = gemv_copies = self._keep_gemv_copies_if_faster()
        if self.quantized:
            self._choose_low_bit_rows(max_int4_rows, max_int8_head_rows)
        self.device = weights.embed.device
        # one rotary embedding per distinct rope (Gemma 3's sliding layers have their own base), and per layer its index
        ropes = [config]
        if config.local_rope_theta is not None:
            ropes.append(dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))
        self._ropes = [RotaryEmbedding(r, self.dtype, self.device) for r in ropes]
        self._layer_rope = [1 if len(ropes) > 1 and w is not None else 0 for w in self._windows]
        self._embed_scale = (None if config.embedding_multiplier is None
                             else torch.tensor(config.embedding_multiplier, dtype=self.dtype, device=self.device))
        c = self._local
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self._compiled_layers = None
        self.decode_kernel = None
        """`engine.paged_decode.CompiledDecode`, the CPU decode attention (`worker.kernels`); None: grouped."""
        self.prefill_kernel = None
        """`engine.flex_prefill.CompiledPrefill`, the CPU prompt chunks' attention (`worker.kernels`); None: SDPA."""
        self.prefill_attn_dtype = None
        """Prompt chunks' SDPA dtype on the CPU (`engine.prefill_choice`); None: ``attn_dtype``."""
        self.glue = None
        """`engine.glue.CompiledGlue` for the rotary embedding, the residual add + RMSNorm and
        SiLU x up of every pass (set by `worker.kernels` with the attention kernels; used where
        `glue_applies`); None: the eager operators."""
        self._glue_applies: bool | None = None
        if compiled:
            self._compile()

    def glue_applies(self) -> bool:
        """Whether `glue` (`engine.glue.CompiledGlue`) can take this model's operators between the
        matmuls: on the CPU, low-precision activations (bfloat16) or 4-bit weights (native mode,
        float32 activations where the CPU has no bfloat16 matmuls, the KV cache then in bfloat16),
        one rank, whole-head rotary, a SiLU-gated MLP, and no QKV bias, Q/K norm, post-norm or
        routed experts (the layers of SmolLM2 and Llama, not Qwen2's, Qwen3's or Gemma's). fp32
        mode, the reference, keeps the eager operators."""
        if self._glue_applies is None:   # the layers are built: decided once
            c = self.config
            self._glue_applies = (
                self.device.type == "cpu" and (self.dtype != torch.float32 or self.quantized)
                and self.tp.size == 1 and (c.rotary_dim or c.head_dim) == c.head_dim and c.hidden_act == "silu"
                and all(e.bqkv is None and e.qk_norm is None for e in self._extras)
                and all(a is None and f is None for a, f in self._post_norms)
                and all(e is None for e in self._experts)
                and all(a is not None and f is not None and a.dim() == f.dim() == 1 for a, f in self._norms))
        return self._glue_applies

    def projection_kernels(self) -> list:
        """The first layer's projection kernels (`Linear`, `Int4Linear`): every layer's have their shapes."""
        return [p for p in vars(self._layers[0]).values() if p is not None]

    def kv_layers(self) -> list[LayerKV]:
        """Every layer stores ``num_kv_heads`` K and V heads of ``head_dim`` per token (with
        tensor parallelism, this rank's KV heads: `engine.tp.local_config`)."""
        return [LayerKV(self._local.num_kv_heads, self._local.head_dim)] * self.config.num_layers

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
        if pool.kv.dtype != self.kv_dtype:
            raise ValueError(f"KV pool dtype {pool.kv.dtype} differs from the model's {self.kv_dtype}")
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        tables = [rope.cos_sin(batch) for rope in self._ropes]
        slots = (batch.slot_mapping // pool.block_size, batch.slot_mapping % pool.block_size)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
            k_pool, v_pool = pool.layer_view(i)
            store_kv(k_pool, slots, k)
            store_kv(v_pool, slots, v)
            if on_layer_done is not None:   # the layer's K/V are in the pool
                on_layer_done(i)
            return paged_attention(q, k, v, k_pool, v_pool, batch, pool.block_size, self._windows[i],
                                   self.config.attn_scale, self.config.attn_softcap, self.decode_kernel,
                                   self.prefill_kernel, self.prefill_attn_dtype)

        if self._compiled_layers is None:
            return self._layers_forward(batch.input_ids, tables, batch.logits_indices, attend)
        with PassContext(attend):
            return self._compiled_layers(batch.input_ids, tables, batch.logits_indices, None)

    def _mm(self, kernel, x: torch.Tensor, compiled: bool) -> torch.Tensor:
        return torch.ops.pdserve.matmul(x, kernel.kernel_id) if compiled else kernel(x)

    def _layers_forward(self, input_ids: torch.Tensor, tables: list, logits_indices: torch.Tensor,
                        attend) -> torch.Tensor:
        """Embedding, layers, final norm and head: ``[T]`` token ids -> ``[N]`` rows of logits.
        ``attend`` None: compiled (matmuls and attention through the custom operators of
        `engine.compiled`), else eager with ``attend(q, k, v, layer)``."""
        c = self._local
        compiled = attend is None
        h = self._embed_tokens(input_ids)
        if self._embed_scale is not None:   # Gemma: times sqrt(hidden) rounded to the weights' dtype
            h = h * self._embed_scale
        t = h.shape[0]
        kv_cast, q_cast = self.kv_dtype != self.dtype, self.attn_dtype != self.dtype
        qk_size, heads = self._q_size + self._kv_size, c.num_heads + c.num_kv_heads
        glue = self.glue
        if compiled or glue is None or not glue.takes(t) or not self.glue_applies():
            glue = None
        x = None   # the next layer's normed input, when the glue computed it with the residual add
        for i, ((attn_norm, ffn_norm), (post_attn, post_ffn), lin, extra, experts) in enumerate(
                zip(self._norms, self._post_norms, self._layers, self._extras, self._experts)):
            if x is None:
                x = _rms_norm(h, (c.hidden_size,), attn_norm, c.rms_norm_eps)
            qkv = self._mm(lin.wqkv, x, compiled)
            if glue is not None:   # the rotation and Q's cast fused (engine.glue)
                q, k, v = glue.rope_split(qkv, *tables[self._layer_rope[i]], c.num_heads, c.num_kv_heads,
                                          c.head_dim, self.attn_dtype, self.kv_dtype)
            else:
                if extra.bqkv is not None:
                    qkv = qkv + extra.bqkv
                qk = qkv[:, :qk_size].view(t, heads, c.head_dim)
                if extra.qk_norm is not None:   # Qwen3, Gemma 3: RMSNorm per head, Q's weight and K's
                    qk = _rms_norm(qk, (c.head_dim,), extra.qk_norm, c.rms_norm_eps)
                qk = _rotate(qk, *tables[self._layer_rope[i]])   # Q and K heads at once
                q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
                v = qkv[:, qk_size:].view(t, c.num_kv_heads, c.head_dim)
                if kv_cast:   # attention on the K/V as stored (paged_attention casts them to q's dtype)
                    k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
                if q_cast:
                    q = q.to(self.attn_dtype)
            if compiled:
                attn = torch.ops.pdserve.attention(q.contiguous(), k.contiguous(), v.contiguous(), i)
            else:
                attn = attend(q, k, v, i)
            if q_cast:
                attn = attn.to(self.dtype)
            out = self.tp.all_reduce(self._mm(lin.wo, attn, compiled))
            if extra.bo is not None:
                out = out + extra.bo
            if post_attn is not None:   # Gemma: the attention output normed before the residual add
                out = _rms_norm(out, (c.hidden_size,), post_attn, c.rms_norm_eps)
            if glue is not None:
                h, x = glue.add_norm(h, out, ffn_norm, c.rms_norm_eps)
            else:
                h = h + out
                x = _rms_norm(h, (c.hidden_size,), ffn_norm, c.rms_norm_eps)
            if experts is not None:
                out = self._mm(experts, x, compiled)
            elif glue is not None:
                out = self._mm(lin.w_down, glue.silu_mul(self._mm(lin.w_gate_up, x, compiled)), compiled)
            else:
                gate, up = self._mm(lin.w_gate_up, x, compiled).chunk(2, dim=-1)
                out = self._mm(lin.w_down, self._act(gate) * up, compiled)
            out = self.tp.all_reduce(out)
            if post_ffn is not None:
                out = _rms_norm(out, (c.hidden_size,), post_ffn, c.rms_norm_eps)
            x = None
            if glue is not None and i + 1 < len(self._layers):   # with the next layer's input norm
                h, x = glue.add_norm(h, out, self._norms[i + 1][0], c.rms_norm_eps)
            else:
                h = h + out
        h = _rms_norm(h.index_select(0, logits_indices), (c.hidden_size,), self._final_norm, c.rms_norm_eps)
        if self.quantized:   # HeadLinear returns its rows' dtype: float32 rows keep the logits' precision
            h = h.float()
        logits = self._mm(self._lm_head, h, compiled).float()
        if self.tp.size > 1:
            logits = self.tp.gather_columns(logits, self._vocab_width, c.vocab_size)
        if c.final_softcap is not None:   # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` embeddings; vocabulary-parallel with a TP size above 1
        (rows outside this rank's are zeros here, and the all-reduce adds the owner's)."""
        if self.tp.size == 1:
            return self._embed.index_select(0, input_ids)
        local = input_ids - self._vocab_first
        mine = (local >= 0) & (local < self._vocab_count)
        h = self._embed.index_select(0, local.clamp(0, max(self._vocab_count - 1, 0)))
        return self.tp.all_reduce(h * mine[:, None].to(h.dtype))

    def warm_up(self, pool: KVPool) -> float:
        """With compiled layers, build their graphs now rather than at the first requests: one
        pass of each shape kind (one token; one prompt of several tokens; two one-token
        sequences) over two blocks of ``pool`` taken and given back. Returns the seconds it took
        (0.0 when nothing is compiled). With a `decode_kernel` (`engine.paged_decode.CompiledDecode`), its package
        too (loaded or built), by a decode pass of as many sequences as it takes (its ``min_rows``);
        with a `prefill_kernel` (`engine.flex_prefill.CompiledPrefill`), its package (its
        ``warm_up``, on this model's head shapes); with a `glue` that applies here, its packages
        (its ``warm_up``). Raises ValueError when ``pool`` has fewer than two free blocks."""
        glue = self.glue if self.glue is not None and self.glue_applies() else None
        if self._compiled_layers is None and self.decode_kernel is None and self.prefill_kernel is None and glue is None:
            return 0.0
        t0 = time.perf_counter()
        if glue is not None:
            c = self._local
            glue.warm_up(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, self.dtype,
                         self.attn_dtype, self.kv_dtype, self._norms[0][0].dtype, c.rms_norm_eps)
        if self.prefill_kernel is not None:
            c = self._local
            self.prefill_kernel.warm_up(c.num_heads, c.num_kv_heads, c.head_dim, self.attn_dtype, self.device,
                                        self.config.attn_scale)
        if self._compiled_layers is None and self.decode_kernel is None:
            return time.perf_counter() - t0
        bs = pool.block_size
        blocks = pool.allocator.try_allocate(2)
        if blocks is None:
            raise ValueError("warming up the compiled layers needs 2 free KV blocks")
        try:
            rows = 2 if self.decode_kernel is None else max(2, self.decode_kernel.min_rows)
            for chunks in ([SeqChunk([1], 0, blocks[:1])], [SeqChunk([1] * min(bs, 4), 0, blocks[:1])],
                           [SeqChunk([1], 1, blocks[i % 2:i % 2 + 1]) for i in range(rows)]):
                self.forward(ForwardBatch.build(chunks, bs), pool)
        finally:
            pool.allocator.free(blocks)
        return time.perf_counter() - t0

    def measure_decode_rows(self, pool: KVPool, threads_for) -> dict:
        """Time the `decode_kernel` against the grouped path below its ``min_rows`` on layer 0
        and set ``min_rows`` by it (`engine.paged_decode.measure_min_rows`, ``threads_for(rows)``
        its thread counts), over blocks taken from ``pool`` for a ``MEASURE_CONTEXT``-token
        context (fewer when fewer are free) and given back. Returns its times, ``{}`` (nothing
        changed) when no block is free or the model has no decode kernel."""
        from engine.paged_decode import MEASURE_CONTEXT, measure_min_rows

        if self.decode_kernel is None or not pool.allocator.num_free:
            return {}
        blocks = pool.allocator.allocate(min(MEASURE_CONTEXT // pool.block_size + 1, pool.allocator.num_free))
        try:
            return measure_min_rows(self.decode_kernel, (self._local.num_heads, self._local.head_dim),
                                    self.attn_dtype, *pool.layer_view(0), blocks, self._windows[0],
                                    self.config.attn_scale, self.config.attn_softcap, threads_for)
        finally:
            pool.allocator.free(blocks)

    def _compile(self) -> None:
        """Register every projection, expert block and the head with `engine.compiled` and
        compile the layers (the graphs themselves are built at the first passes)."""
        kernels = [p for lin in self._layers for p in vars(lin).values() if p is not None]
        kernels += [e for e in self._experts if e is not None] + [self._lm_head]
        for k in kernels:
            out = self.config.hidden_size if isinstance(k, RoutedExperts) else k.out_features
            k.kernel_id = register_kernel(k, out)
        self._compiled_layers = compile_fn(self._layers_forward)

    def _bf16_activations(self) -> None:
        """4-bit (native) weights on a CPU that multiplies bfloat16 natively: the activations
        (embedding rows, residual stream, the projections' inputs and outputs) in bfloat16, as
        transformers runs a bfloat16 checkpoint, instead of float32 cast to bfloat16 before and
        back after every projection, whose kernels (`Int4Linear`) compute from bfloat16 inputs
        either way. RMSNorm still normalizes in float32 and scales by its float32 weight
        (`_rms_norm`), attention still runs in float32 (``attn_dtype``), and the head takes
        float32 rows. Not with tensor parallelism (the all-reduce would sum bfloat16 partials)
        or routed experts (their kernels take float32). Its tolerance against fp32 mode is
        tests/integration/test_engine_reference.py's."""
        self.dtype = torch.bfloat16
        self._embed = self._embed.to(self.dtype)
        for extra in self._extras:
            extra.bqkv = None if extra.bqkv is None else extra.bqkv.to(self.dtype)
            extra.bo = None if extra.bo is None else extra.bo.to(self.dtype)

    def _keep_gemv_copies_if_faster(self) -> bool:
        """Time one-row inputs through the gemv copies and the packed weights (layer 0's
        projections and the head, `engine.linear.gemv_copy_pays`); drop every copy if they do
        not pay. Called once layer 0 and the head are built, before the other layers. Returns
        whether copies are kept."""
        probe = [p for p in (*vars(self._layers[0]).values(), self._lm_head)
                 if isinstance(p, Linear) and p.has_gemv_copy]   # the only layer built yet
        if not probe:
            return False
        if gemv_copy_pays(probe):
            log.info("one-row float32 projections: MKL sgemv on plain copies (measured faster)")
            return True
        for p in (*(q for lin in self._layers for q in vars(lin).values()), self._lm_head):
            if isinstance(p, Linear):
                p.drop_gemv_copy()
        log.info("one-row float32 projections: oneDNN packed (measured faster than sgemv copies)")
        return False

    def _choose_low_bit_rows(self, int4_rows: int | None, head_rows: int | None) -> None:
        """Set the int4 projections' kernel and rows per pass thread count and the int8 head's rows,
        measuring those left None (`engine.tuning`, `measure_max_low_bit_rows`)."""
        int4 = [p for lin in self._layers for p in vars(lin).values() if isinstance(p, Int4Linear)]
        how = ["measured" if rows is None else "given" for rows in (int4_rows, head_rows)]
        threads = torch.get_num_threads()
        if int4_rows is None and int4:   # built with both low-bit kernels: a plan per pass thread count
            self.low_bit_plans, how[0] = tuned_low_bit_plans(int4, self._low_bit_threads)
        elif int4:
            self.low_bit_plans = {threads: (int4[0].kernel, int4_rows or 0)}
            for p in int4:
                p.set_plans(self.low_bit_plans)
        self.low_bit_kernel, self.max_int4_rows = int4[0].plan_for(threads) if int4 else (None, 0)
        if head_rows is None:
            head_rows = measure_max_low_bit_rows([self._lm_head], candidates=(1, 2, 4), reps=3)
        self._lm_head.set_max_rows(head_rows)
        self.max_int8_head_rows = head_rows
        log.info("native weights: 4-bit projections through %s (%s), int8 head up to %d rows (%s)", ", ".join(
            f"the {k} kernel up to {r} rows on {n} thread(s)" for n, (k, r) in self.low_bit_plans.items()) or "none",
            how[0], head_rows, how[1])


class _LayerExtras:
    """A layer's optional parts: Q/K/V and output biases, and the Q/K norm weights stacked per
    head (``[num_heads + num_kv_heads, head_dim]``: one multiply scales both)."""

    def __init__(self, layer, config: ModelConfig):
        self.bqkv, self.bo = layer.bqkv, layer.bo
        self.qk_norm = None
        if layer.q_norm is not None:
            self.qk_norm = torch.cat([layer.q_norm.expand(config.num_heads, -1),
                                      layer.k_norm.expand(config.num_kv_heads, -1)])


class _LayerLinears:
    """A layer's projections as kernels (`Linear`, `Int4Linear`; None where the layer has
    experts instead), each original set to None in ``layer`` as soon as its kernel is built."""

    def __init__(self, layer: LayerWeights, backend: str, max_int4_rows: int, gemv_copies: bool,
                 low_bit_kernels: tuple[str, ...]):
        def make(w):
            return (Int4Linear(w, max_int4_rows, backend, low_bit_kernels) if isinstance(w, Int4Weight)
                    else Linear(w, backend, gemv_copies))

        for name in ("wqkv", "wo", "w_gate_up", "w_down"):   # forward order (`vars` relies on it)
            w = getattr(layer, name)
            setattr(layer, name, None)
            setattr(self, name, None if w is None else make(w))
            w = None


def _rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, scaled by ``weight`` (``shape``, or with leading dims that
    broadcast: per-head Q/K norms ``[heads, head_dim]``). Float32 input: ``F.rms_norm``. Lower
    precision (bfloat16): normalized in float32, then cast back and scaled by a weight of
    ``x``'s dtype, as Hugging Face's ``LlamaRMSNorm`` does (``F.rms_norm`` on bfloat16 loses
    enough that SmolLM2-135M's greedy answers change: "What is the capital of France?" stops
    answering Paris), or scaled in float32 by a float32 weight and then cast, as
    ``Gemma2RMSNorm`` does."""
    if x.dtype == torch.float32:
        if weight is None or weight.shape == shape:
            return F.rms_norm(x, shape, weight, eps)
        return F.rms_norm(x, shape, None, eps) * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xf.to(x.dtype)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, "rotate half" convention: Hugging Face's
    ``x * cos + cat(-x2, x1) * sin`` computed as ``x * cos + cat(x2, x1) * signed_sin`` (one
    ``roll`` instead of two slices, a negation and a cat; bit-identical, since negating a factor
    of a product is exact). ``x``: ``[tokens, heads, head_dim]``; tables ``[tokens, 1, rotary_dim]``:
    with ``rotary_dim < head_dim`` (partial rotary, Phi-3) the first ``rotary_dim`` dimensions
    rotate and the rest pass through."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([_rotate(x[..., :dim], cos, signed_sin), x[..., dim:]], dim=-1)
    return x * cos + x.roll(dim // 2, -1) * signed_sin
