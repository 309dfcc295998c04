"""A Hugging Face ``config.json`` read into a `ModelConfig`, or refused with the field named.

Both spellings transformers has written are read: transformers 4 puts ``rope_theta`` and
``rope_scaling`` at the top level; transformers 5 puts both inside ``rope_parameters``
(``rope_type`` or the older ``type`` key; ``original_max_position_embeddings`` at the top level,
as Phi-3 has it, wins). Anything the engine does not implement is a `ModelLoadError` naming the
field and its value: a rope type, an attention kind, an activation, a bias, a
``quantization_config``. Nothing is silently dropped.

Two rope types change the context the engine serves (`ModelConfig.max_position`), as vLLM's
``_get_and_verify_max_len`` does: ``dynamic`` rescales past ``max_position_embeddings``, so the
context is that times ``factor`` (otherwise the scaling never applies); ``longrope`` already
gives the long context as ``max_position_embeddings`` (Phi-3's ``original_max_position_embeddings``
is the short one).
"""

from __future__ import annotations

from engine.config import ROPE_TYPES, ModelConfig, RopeScaling
from engine.errors import ModelLoadError

FAMILIES = {
    # model_type: (qkv bias, q/k norm) that the family always has
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
    "mixtral": (False, False),
    "phi3": (False, False),
    "gemma2": (False, False),
    "gemma3_text": (False, True),
}
"""The ``model_type`` values this reader understands, and the layer features each one implies."""

GEMMA = {"gemma2", "gemma3_text"}
"""Gemma 2 and 3 (text): GeGLU, ``(1 + w)`` norms around attention and MLP, a scaled embedding,
``query_pre_attn_scalar``, soft-capping; Gemma 3 adds per-layer-type rope parameters."""

_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""Hugging Face activation names (``hidden_act`` / Gemma's ``hidden_activation``) -> `ModelConfig.hidden_act`."""

PARTIAL_ROTARY = {"phi3"}
"""Families whose attention rotates only the first ``partial_rotary_factor`` of each head."""

_ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
    "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate",
    "short_factor", "long_factor",
}

ROPE_ALIASES = {"phi3": {"su": "longrope", "yarn": "longrope"}}
"""Older rope type names, per family, read as transformers' config classes read them
(``Phi3Config``: "su" and "yarn" are longrope)."""


def _refuse(where: str, field: str, value, why: str = "is not supported") -> ModelLoadError:
    return ModelLoadError(f"{where}: {field}={value!r} {why}")


def rope_from_hf(hf: dict, where: str) -> tuple[float, RopeScaling | None, float]:
    """``(rope_theta, scaling, partial_rotary_factor)`` from either spelling (module docstring).

    Raises:
        ModelLoadError: an unknown rope type or parameter, or per-layer-type rope parameters.
    """
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
    elif not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise _refuse(where, "rope_parameters", params, "(per layer type) is not supported")
    else:
        params = dict(params)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = ROPE_ALIASES.get(hf.get("model_type"), {}).get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise _refuse(where, "rope_type", rope_type, f"is not supported; supported: {', '.join(ROPE_TYPES)}")
    unknown = set(params) - _ROPE_KEYS
    if unknown:
        raise _refuse(where, "rope_parameters", {k: params[k] for k in sorted(unknown)},
                      "has parameters the engine does not implement")
    if rope_type == "default":
        return float(theta), None, partial
    original = hf.get("original_max_position_embeddings",
                      params.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    factor = params.get("factor", 1.0)
    if rope_type == "dynamic":   # transformers rescales past max_position_embeddings, whatever else is set
        original = hf.get("max_position_embeddings", 2048)
        if "factor" not in params:
            raise _refuse(where, "rope_parameters", params, "(dynamic) lacks factor")
    elif rope_type == "longrope" and "factor" not in params and original:
        factor = int(hf.get("max_position_embeddings", 2048)) / int(original)
    short, long = _numbers(params, "short_factor", where), _numbers(params, "long_factor", where)
    try:
        scaling = RopeScaling(
            rope_type=rope_type, factor=float(factor),
            original_max_position=int(original) if original is not None else None,
            low_freq_factor=params.get("low_freq_factor"), high_freq_factor=params.get("high_freq_factor"),
            beta_fast=params.get("beta_fast"), beta_slow=params.get("beta_slow"),
            attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(params.get("truncate", True)),
            short_factor=short, long_factor=long)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: rope_type={rope_type!r}: {exc}") from None
    if rope_type == "llama3" and (scaling.low_freq_factor is None or scaling.high_freq_factor is None):
        raise _refuse(where, "rope_parameters", params, "(llama3) lacks low_freq_factor / high_freq_factor")
    return float(theta), scaling, partial


def _numbers(params: dict, key: str, where: str) -> tuple[float, ...] | None:
    """``params[key]`` as a tuple of floats (None when absent); anything but a list of numbers is
    refused by name."""
    values = params.get(key)
    if values is None:
        return None
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise _refuse(where, key, values, "must be a list of numbers")
    return tuple(float(v) for v in values)


def _context(hf: dict, scaling: RopeScaling | None) -> int:
    """`ModelConfig.max_position`: ``max_position_embeddings``, times ``factor`` for ``dynamic``
    (module docstring)."""
    context = int(hf.get("max_position_embeddings", 2048))
    if scaling is not None and scaling.rope_type == "dynamic":
        return int(context * scaling.factor)
    return context


def model_config_from_hf(hf: dict, name: str, where: str) -> ModelConfig:
    """The `ModelConfig` of a ``config.json`` dict.

    Args:
        name: the model's display name (the directory's).
        where: what to name in errors (the file).
    Raises:
        ModelLoadError: an unknown ``model_type``, a missing field, or a feature the engine does not
            implement (the message names the field and its value).
    """
    model_type = hf.get("model_type") or "llama"
    if model_type not in FAMILIES:
        raise _refuse(where, "model_type", model_type, f"is not supported; supported: {', '.join(FAMILIES)}")
    if hf.get("quantization_config"):
        raise _refuse(where, "quantization_config", hf["quantization_config"].get("quant_method", "?"),
                      "(a pre-quantized checkpoint) is not supported")
    act_field = "hidden_activation" if model_type in GEMMA and "hidden_activation" in hf else "hidden_act"
    act = hf.get(act_field, "gelu_pytorch_tanh" if model_type in GEMMA else "silu")   # the config classes' defaults
    if act not in _ACTS:
        raise _refuse(where, act_field, act, f"is not supported; supported: {', '.join(_ACTS)}")
    if hf.get("use_bidirectional_attention"):
        raise _refuse(where, "use_bidirectional_attention", True, "(an embedding model) is not supported")
    if hf.get("mlp_bias"):
        raise _refuse(where, "mlp_bias", hf["mlp_bias"])
    qkv_bias, qk_norm = FAMILIES[model_type]
    attention_bias = bool(hf.get("attention_bias", False))
    theta, scaling, partial, local_theta = _rope(hf, model_type, where)
    if partial != 1.0 and model_type not in PARTIAL_ROTARY:
        raise _refuse(where, "partial_rotary_factor", partial, f"is not supported for {model_type}")
    moe = _experts(hf, model_type, where)
    try:
        window, window_layers = _windows(hf, model_type, int(hf["num_hidden_layers"]), where)
        heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
        return ModelConfig(
            name=name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=_context(hf, scaling),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in GEMMA)),
            architecture=model_type,
            rope_scaling=scaling,
            sliding_window=window,
            window_layers=window_layers,
            local_rope_theta=local_theta,
            hidden_act=_ACTS[act],
            rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=qk_norm,
            **moe,
            **_gemma(hf, model_type),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: missing field {exc.args[0]!r}") from None


def _experts(hf: dict, model_type: str, where: str) -> dict:
    """The `ModelConfig` MoE fields: Mixtral routes every layer (``num_local_experts``, weights
    always renormalized); Qwen3-MoE (``num_experts``, or ``num_local_experts`` as transformers 5
    writes it) every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers`` (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``)."""
    try:
        if model_type == "mixtral":
            layers = tuple(range(int(hf["num_hidden_layers"])))
            return dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                        moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True, moe_layers=layers)
        if model_type == "qwen3_moe":
            # transformers 4 writes num_experts, 5 num_local_experts (as Mixtral always did)
            experts = hf.get("num_experts", hf.get("num_local_experts"))
            if experts is None:
                raise KeyError("num_experts")
            experts = int(experts)
            step = int(hf.get("decoder_sparse_step", 1))
            dense = set(hf.get("mlp_only_layers") or ())
            layers = tuple(i for i in range(int(hf["num_hidden_layers"]))
                           if i not in dense and experts > 0 and (i + 1) % step == 0)
            return dict(num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                        moe_intermediate_size=int(hf["moe_intermediate_size"]),
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=layers)
    except KeyError as exc:
        raise ModelLoadError(f"{where}: missing field {exc.args[0]!r}") from None
    return {}


def _gemma(hf: dict, model_type: str) -> dict:
    """The `ModelConfig` fields of Gemma 2/3's layer (source: transformers ``modeling_gemma2.py``,
    ``modeling_gemma3.py``): ``(1 + w)`` norms, norms after attention and MLP, the embedding
    scaled by ``sqrt(hidden_size)``, scores scaled by ``query_pre_attn_scalar ** -0.5``, soft-capping."""
    if model_type not in GEMMA:
        return {}
    return dict(norm_offset=1.0, sandwich_norms=True, embedding_multiplier=float(hf["hidden_size"]) ** 0.5,
                attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"))


def _rope(hf: dict, model_type: str, where: str) -> tuple[float, RopeScaling | None, float, float | None]:
    """`rope_from_hf` plus the sliding layers' own base: Gemma 3 gives each layer type its rope
    parameters (transformers 5: ``rope_parameters`` keyed by ``full_attention`` and
    ``sliding_attention``; transformers 4: ``rope_local_base_freq`` beside the global ones)."""
    if model_type != "gemma3_text":
        return (*rope_from_hf(hf, where), None)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
            raise _refuse(where, "rope_parameters.sliding_attention", local, "(scaled local rope) is not supported")
        return (*rope_from_hf({**hf, "rope_parameters": params["full_attention"]}, where),
                float(local.get("rope_theta", 10000.0)))
    return (*rope_from_hf(hf, where), float(hf.get("rope_local_base_freq", 10000.0)))


SLIDING_WINDOW = {"mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"}
"""Families whose layers may attend through a ``sliding_window`` (every layer, or those
``layer_types`` names "sliding_attention")."""

_QWEN = {"qwen2", "qwen3", "qwen3_moe"}
_LAYER_TYPES = {"full_attention", "sliding_attention"}


def _windows(hf: dict, model_type: str, num_layers: int, where: str) -> tuple[int | None, tuple[int, ...] | None]:
    """``(sliding_window, window_layers)`` (`ModelConfig`): which layers slide, from ``layer_types``
    when the config has it (transformers 5), else as each family's transformers 4 code derives
    it: Qwen only with ``use_sliding_window`` (Qwen2/3: layers from ``max_window_layers`` on;
    Qwen3-MoE: all), Gemma 2 the even layers, Gemma 3 all but every ``sliding_window_pattern``-th,
    Mistral, Mixtral and Phi-3 every layer. A window not shorter than the context is none.

    Raises:
        ModelLoadError: an attention kind other than full and sliding, ``layer_types`` of the wrong
            length, or a window in a family that has none (Llama).
    """
    kinds = hf.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - _LAYER_TYPES:
            raise _refuse(where, "layer_types", kinds, f"must list {num_layers} of {sorted(_LAYER_TYPES)}")
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    elif model_type in _QWEN:
        if not hf.get("use_sliding_window", False):
            return None, None   # Qwen keeps a window size in its config, used only with use_sliding_window
        first = 0 if model_type == "qwen3_moe" else int(hf.get("max_window_layers", num_layers))
        sliding = list(range(first, num_layers))
    elif model_type == "gemma2":
        sliding = list(range(0, num_layers, 2))
    elif model_type == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern", 6))
        sliding = [i for i in range(num_layers) if (i + 1) % pattern]
    else:
        sliding = list(range(num_layers))
    window = hf.get("sliding_window")
    if not sliding or window is None or int(window) >= int(hf.get("max_position_embeddings", 2048)):
        if sliding and window is None and kinds is not None:
            raise _refuse(where, "sliding_window", None, "is missing for the layers layer_types makes sliding")
        return None, None
    if model_type not in SLIDING_WINDOW:
        raise _refuse(where, "sliding_window", window, f"(shorter than the context) is not supported for {model_type}")
    return int(window), None if len(sliding) == num_layers else tuple(sliding)
