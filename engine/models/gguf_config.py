"""A GGUF file's metadata read into a `ModelConfig`, or refused with the key named.

The architectures are those llama.cpp writes (``general.architecture``, gguf-py
``MODEL_ARCH_NAMES``); each maps to the `ModelConfig` the same checkpoint's Hugging Face
``config.json`` gives (`engine.models.hf_config`). Hyper-parameters are read under
``{arch}.*`` (gguf-py ``Keys.LLM`` / ``Keys.Attention`` / ``Keys.Rope``), written by llama.cpp's
converter (``convert_hf_to_gguf.py``, since split into ``conversion/base.py``
``TextModel.set_gguf_parameters`` and one module per family: ``conversion/llama.py``,
``qwen.py``, ``phi.py``, ``gemma.py``). Every ``{arch}.*`` key not in `_KNOWN_KEYS` is refused, as is any
value the engine does not implement (a rope scaling type, a gating function, shared experts):
nothing is silently dropped. Which *tensors* a family has is `GGUFFamily`'s business; the
weights loader (`engine.gguf_weights`) refuses tensors it does not use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError
from engine.modelfile import gguf_field


@dataclass(frozen=True)
class GGUFFamily:
    """What a GGUF architecture implies beyond its metadata.

    Fields:
        model_type: `ModelConfig.architecture` (the Hugging Face ``model_type`` the converter
            read; `engine.models.registry` key).
        permuted_qk: the converter permuted Q/K rows for llama.cpp's NORM (adjacent-pair) rope
            (``LlamaModel.permute``, ``undo_permute = True``, ``conversion/llama.py``); the
            loader undoes it. NEOX-rope families (``llama_model_rope_type`` in
            ``src/llama-model.cpp``: qwen2, qwen3, qwen3moe, phi3) are written unpermuted.
        qkv_bias: ``attn_q/k/v.bias`` always present (Qwen2); otherwise optional (Llama's
            ``attention_bias``, read from the tensors).
        qk_norm: ``attn_q_norm`` / ``attn_k_norm`` per-head RMSNorm (Qwen3).
        fused: Q/K/V stacked in ``attn_qkv`` and gate/up in ``ffn_up`` (Phi-3: the converter
            maps ``qkv_proj`` / ``gate_up_proj`` unchanged; ``src/models/phi3.cpp`` runs
            ``ffn_up`` as SWIGLU, gate half first).
        experts: routed-expert layers allowed (``ffn_gate_inp``, ``ffn_*_exps``).
        moe_model_type: ``model_type`` when the file has experts (llama.cpp writes Mixtral as
            llama).
        partial_rotary: ``rope.dimension_count`` may be below ``head_dim`` (Phi-3).
        sliding_window: a window shorter than the context is honoured (Mistral, as the Hugging
            Face path; elsewhere refused, as there).
        swa_period: Gemma (`_gemma`): every ``swa_period``-th layer attends fully, the others
            through the window, unless ``attention.sliding_window_pattern`` says otherwise; 0:
            not Gemma.
    """

    model_type: str
    permuted_qk: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    experts: bool = False
    moe_model_type: str = ""
    partial_rotary: bool = False
    sliding_window: bool = False
    swa_period: int = 0


FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", permuted_qk=True, experts=True, moe_model_type="mixtral", sliding_window=True),
    "qwen2": GGUFFamily("qwen2", qkv_bias=True),
    "qwen3": GGUFFamily("qwen3", qk_norm=True),
    "qwen3moe": GGUFFamily("qwen3_moe", qk_norm=True, experts=True, moe_model_type="qwen3_moe"),
    "phi3": GGUFFamily("phi3", fused=True, partial_rotary=True),
    "gemma2": GGUFFamily("gemma2", sliding_window=True, swa_period=2),
    "gemma3": GGUFFamily("gemma3_text", qk_norm=True, sliding_window=True, swa_period=6),
}
"""``general.architecture`` -> `GGUFFamily`."""

_KNOWN_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_weights_norm",
    "expert_gating_func", "expert_shared_count",
}
"""``{arch}.*`` keys this reader interprets (any other is refused)."""
_GEMMA_KEYS = {"attn_logit_softcapping", "final_logit_softcapping", "rope.freq_base_swa",
               "attention.sliding_window_pattern"}
"""More keys read for Gemma (`_gemma`)."""
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Layer counts llama.cpp takes for the 27B models, whose query scale is ``(hidden / heads) ** -0.5``."""

_SOFTMAX_GATING = 1   # gguf-py ExpertGatingFuncType.SOFTMAX


def _refuse(path: Path, key: str, value, why: str = "is not supported") -> ModelLoadError:
    return ModelLoadError(f"{path}: {key}={value!r} {why}")


class _Meta:
    """``{arch}.*`` metadata lookups that name the key when it is missing."""

    def __init__(self, reader, arch: str, path: Path):
        self.reader, self.arch, self.path = reader, arch, path

    def get(self, key: str, default=None):
        return gguf_field(self.reader, f"{self.arch}.{key}", default)

    def real(self, key: str, default=None) -> float | None:
        """A float32 key as the shortest decimal that rounds to it (GGUF stores float32: 1e-5
        reads back as 9.99999975e-06; this gives 1e-05, the value the converter was given)."""
        value = self.get(key, default)
        return None if value is None else float(str(np.float32(value)))

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value


def family_of(reader, path: Path) -> tuple[str, GGUFFamily]:
    """``(general.architecture, its GGUFFamily)``.

    Raises:
        ModelLoadError: an architecture not in `FAMILIES` (named, with the supported ones).
    """
    arch = gguf_field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise _refuse(path, "general.architecture", arch, f"is not supported; supported: {', '.join(FAMILIES)}")
    return arch, FAMILIES[arch]


def model_config_from_gguf(reader, path: Path) -> ModelConfig:
    """The `ModelConfig` of a parsed GGUF file (``gguf.GGUFReader``).

    Head width: ``attention.key_length`` (written when ``config.json`` has ``head_dim``), else
    ``embedding_length / head_count``. Rotary width: ``rope.dimension_count`` (Phi-3 writes
    ``partial_rotary_factor * head_dim``). MoE layers are those with an ``ffn_gate_inp`` tensor
    (llama.cpp has no key for Qwen3-MoE's ``mlp_only_layers``); top-k weights are renormalized
    unless ``expert_weights_norm`` says otherwise (``src/models/qwen3moe.cpp`` and ``llama.cpp``
    call ``build_moe_ffn`` with ``norm_w = true``). No ``output.weight``: tied embeddings.

    Raises:
        ModelLoadError: an unknown architecture or ``{arch}.*`` key, a missing key, or a value
            the engine does not implement (the message names the key and the value).
    """
    arch, fam = family_of(reader, path)
    meta = _Meta(reader, arch, path)
    prefix = arch + "."
    known = _KNOWN_KEYS | (_GEMMA_KEYS if fam.swa_period else set())
    unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k[len(prefix):] not in known)
    if unknown:
        raise _refuse(path, unknown[0], gguf_field(reader, unknown[0]), "is not implemented by the engine")
    hidden, heads = int(meta.need("embedding_length")), int(meta.need("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    value_dim = meta.get("attention.value_length", head_dim)
    if int(value_dim) != head_dim:
        raise _refuse(path, f"{arch}.attention.value_length", value_dim, f"differs from key_length={head_dim}")
    rotary = int(meta.get("rope.dimension_count", head_dim))
    if rotary != head_dim and not fam.partial_rotary:
        raise _refuse(path, f"{arch}.rope.dimension_count", rotary, f"differs from head_dim={head_dim} ({arch})")
    context = int(meta.need("context_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta.get("vocab_size")
    if vocab is None and "token_embd.weight" in names:
        vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    layers = int(meta.need("block_count"))
    moe = _experts(meta, fam, names, layers)
    if fam.swa_period:
        gemma = _gemma(meta, fam, layers, heads, context)
    else:
        gemma = dict(sliding_window=_window(meta, fam, context))
    return ModelConfig(
        name=str(gguf_field(reader, "general.name", path.stem)),
        vocab_size=int(vocab or 0),
        hidden_size=hidden,
        intermediate_size=int(meta.get("feed_forward_length", 0) or meta.get("expert_feed_forward_length", 0)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(meta.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=meta.real("rope.freq_base", 10000.0),
        rms_norm_eps=meta.real("attention.layer_norm_rms_epsilon", meta.need("attention.layer_norm_rms_epsilon")),
        max_position=context,
        tie_word_embeddings="output.weight" not in names,
        architecture=fam.moe_model_type if moe else fam.model_type,
        rope_scaling=_rope_scaling(meta, context, _rope_freqs(reader), rotary),
        rotary_dim=0 if rotary == head_dim else rotary,
        qkv_bias=fam.qkv_bias or "blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm=fam.qk_norm,
        **moe,
        **gemma,
    )


def _rope_freqs(reader) -> np.ndarray | None:
    """The ``rope_freqs.weight`` tensor (float32), or None."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if tensor is None else np.asarray(tensor.data, dtype=np.float32).reshape(-1)


def llama3_rope_factors(base: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The ``rope_freqs`` table llama.cpp's converter writes for Llama 3 scaling
    (``LlamaModel.generate_extra_tensors``, ``conversion/llama.py``): per rotary pair, the
    divisor of its frequency (1 above ``original / high``, ``factor`` below ``original / low``
    in wavelength terms, smoothly between), float32, computed as the converter computes it."""
    import torch

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:   # 0-d float32 tensors, as in the converter: the arithmetic stays float32
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _llama3(meta: _Meta, factors: np.ndarray, rotary: int) -> RopeScaling:
    """Llama 3 scaling recovered from its ``rope_freqs`` table (the converter writes no
    ``rope.scaling.*`` key for it). ``factor`` is the largest divisor; ``low_freq_factor`` /
    ``high_freq_factor`` are taken as 1 and 4 (the converter's defaults, every Llama 3.x's
    values); ``original_max_position_embeddings`` is solved from a divisor of the smooth band
    (8192, the converter's default, when there is none). The parameters are accepted only if
    `llama3_rope_factors` gives back the stored table bit for bit.

    Raises:
        ModelLoadError: a table no such parameters reproduce (named).
    """
    base = meta.real("rope.freq_base", 10000.0)
    factor, low, high = float(str(np.float32(factors.max()))), 1.0, 4.0
    original = 8192
    inv_freq = 1.0 / (base ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary))
    band = [i for i, f in enumerate(factors) if 1.0 < f < factor]
    if band:
        i = band[0]
        smooth = (1 / float(factors[i]) - 1 / factor) / (1 - 1 / factor)
        original = round(2 * math.pi / inv_freq[i] * (smooth * (high - low) + low))
    if len(factors) * 2 == rotary and factor >= 1.0 and np.array_equal(
            llama3_rope_factors(base, rotary, factor, low, high, original), factors):
        return RopeScaling("llama3", factor=factor, original_max_position=original, low_freq_factor=low,
                           high_freq_factor=high)
    raise ModelLoadError(f"{meta.path}: tensor rope_freqs.weight {factors.tolist()} is not a Llama 3 rope scaling "
                         "(low_freq_factor 1, high_freq_factor 4) the engine can reproduce")


def _rope_scaling(meta: _Meta, context: int, factors: np.ndarray | None = None, rotary: int = 0) -> RopeScaling | None:
    """``rope.scaling.*`` (``TextModel.set_gguf_parameters``): "linear" (``factor``) and "yarn"
    (``factor``, ``original_context_length``, ``yarn_beta_fast`` / ``yarn_beta_slow``,
    ``yarn_attn_factor`` as the Hugging Face ``attention_factor``). Llama 3's scaling is not
    metadata but a ``rope_freqs`` tensor (`_llama3`), only with no ``rope.scaling.type``."""
    kind = meta.get("rope.scaling.type")
    if factors is not None:
        if kind not in (None, "none"):
            raise _refuse(meta.path, f"{meta.arch}.rope.scaling.type", kind, "with a rope_freqs tensor is not supported")
        return _llama3(meta, factors, rotary)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise _refuse(meta.path, f"{meta.arch}.rope.scaling.type", kind, "is not supported; supported: none, linear, yarn")
    factor = meta.real("rope.scaling.factor", meta.need("rope.scaling.factor"))
    if kind == "linear":   # the pre-training context, unused by linear (as the Hugging Face path sets it)
        return RopeScaling("linear", factor=factor,
                           original_max_position=int(meta.get("rope.scaling.original_context_length", context)))
    return RopeScaling("yarn", factor=factor, original_max_position=int(meta.need("rope.scaling.original_context_length")),
                       beta_fast=meta.real("rope.scaling.yarn_beta_fast"), beta_slow=meta.real("rope.scaling.yarn_beta_slow"),
                       attention_factor=meta.real("rope.scaling.yarn_attn_factor"))


def _window(meta: _Meta, fam: GGUFFamily, context: int) -> int | None:
    """``attention.sliding_window``: 0 or not shorter than the context means none (Phi-3's
    converter writes 0 for "none"); a shorter one is kept for families that honour it."""
    window = meta.get("attention.sliding_window")
    if not window or int(window) >= context:
        return None
    if not fam.sliding_window:
        raise _refuse(meta.path, f"{meta.arch}.attention.sliding_window", window,
                      f"(shorter than the context) is not supported for {meta.arch}")
    return int(window)


def _gemma(meta: _Meta, fam: GGUFFamily, layers: int, heads: int, context: int) -> dict:
    """The `ModelConfig` fields of a Gemma 2/3 file (as `engine.models.hf_config` sets them), read
    as llama.cpp's loader reads them (``src/models/gemma2.cpp`` ``load_arch_hparams``; Gemma 3 in
    ``src/llama-model.cpp`` ``load_hparams``): the layers that slide are those of
    ``set_swa_pattern(n)``, ``il % n < n - 1`` (every n-th layer global; ``n`` 2 for Gemma 2, 6
    for Gemma 3, or ``attention.sliding_window_pattern``: a period or one flag per layer); the
    sliding layers' rope base is ``rope.freq_base_swa``, else the global one (Gemma 2) or 10000
    (Gemma 3, unscaled); the query scale is ``head_dim ** -0.5`` (``n_embd_head_k``) except for the
    27B layer counts, ``(hidden / heads) ** -0.5``: the converter writes no
    ``query_pre_attn_scalar``. Norm weights arrive with the converter's ``+ 1`` added
    (``conversion/gemma.py`` ``modify_tensors``; `engine.gguf_weights` keeps them as they are).
    """
    pattern = meta.get("attention.sliding_window_pattern", fam.swa_period)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise _refuse(meta.path, f"{meta.arch}.attention.sliding_window_pattern", pattern, f"must flag {layers} layers")
        sliding = [i for i, swa in enumerate(pattern) if swa]
    else:
        n = int(pattern)
        sliding = [i for i in range(layers) if n == 0 or i % n < n - 1]
    window = meta.get("attention.sliding_window")
    if not sliding or not window or int(window) >= context:
        window, window_layers = None, None
    else:
        window, window_layers = int(window), None if len(sliding) == layers else tuple(sliding)
    base = meta.real("rope.freq_base", 10000.0)
    local = meta.real("rope.freq_base_swa", 10000.0 if meta.arch == "gemma3" else base)
    hidden, head_dim = int(meta.need("embedding_length")), int(meta.need("attention.key_length"))
    width = hidden // heads if layers == _GEMMA_27B_LAYERS.get(meta.arch) else head_dim
    return dict(sliding_window=window, window_layers=window_layers,
                local_rope_theta=None if meta.arch == "gemma2" and local == base else local,
                hidden_act="gelu_tanh", norm_offset=1.0, sandwich_norms=True,
                embedding_multiplier=float(hidden) ** 0.5, attn_scale=float(width) ** -0.5,
                attn_softcap=meta.real("attn_logit_softcapping"), final_softcap=meta.real("final_logit_softcapping"))


def _experts(meta: _Meta, fam: GGUFFamily, names: set[str], layers: int) -> dict:
    """The `ModelConfig` MoE fields (empty for a dense file)."""
    moe_layers = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names)
    count = int(meta.get("expert_count", 0))
    if not moe_layers:
        return {}
    key = f"{meta.arch}.expert_count"
    if not fam.experts:
        raise _refuse(meta.path, key, count, f"(routed experts) is not supported for {meta.arch}")
    gating = meta.get("expert_gating_func", _SOFTMAX_GATING)
    if int(gating) != _SOFTMAX_GATING:
        raise _refuse(meta.path, f"{meta.arch}.expert_gating_func", gating, "is not supported (softmax only)")
    shared = meta.get("expert_shared_count", 0)
    if int(shared):
        raise _refuse(meta.path, f"{meta.arch}.expert_shared_count", shared, "(shared experts) is not supported")
    ff = meta.get("expert_feed_forward_length", meta.get("feed_forward_length"))
    if count < 1 or ff is None:
        raise ModelLoadError(f"{meta.path}: MoE tensors but {key}={count} / no expert_feed_forward_length")
    return dict(num_experts=count, num_experts_per_tok=int(meta.need("expert_used_count")),
                moe_intermediate_size=int(ff), norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
                moe_layers=moe_layers)
