"""`engine.models.hf_config`: a ``config.json`` read into a `ModelConfig`, both spellings alike,
what the engine lacks refused by name (the numerics are checked against transformers in
tests/integration/test_model_families.py)."""

from __future__ import annotations

import pytest

from engine.config import RopeScaling
from engine.errors import ModelLoadError
from engine.models.hf_config import model_config_from_hf

pytestmark = pytest.mark.unit

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}


def read(**fields):
    return model_config_from_hf({**BASE, **fields}, "m", "config.json")


def test_transformers_4_and_5_spellings_give_one_config():
    old = read(model_type="llama", rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    older = read(model_type="llama", rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3})
    new = read(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    assert old == older == new
    assert new.rope_theta == 500000.0
    assert new.rope_scaling == RopeScaling("llama3", 8.0, 1024, 1.0, 4.0)


def test_defaults_and_family_features():
    plain = read(model_type="llama")
    assert (plain.rope_theta, plain.rope_scaling, plain.qkv_bias, plain.qk_norm) == (10000.0, None, False, False)
    assert read(model_type="qwen2").qkv_bias and not read(model_type="qwen2").o_bias
    assert read(model_type="llama", attention_bias=True).o_bias
    q3 = read(model_type="qwen3", head_dim=32)
    assert q3.qk_norm and q3.head_dim == 32
    phi = read(model_type="phi3", partial_rotary_factor=0.75)
    assert phi.rotary_dim == 12   # int(16 * 0.75)


def test_moe_layers_follow_sparse_step_and_dense_layers():
    moe = read(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               decoder_sparse_step=2, mlp_only_layers=[3])
    assert moe.moe_layers == (1,) and moe.num_experts == 8 and not moe.norm_topk_prob
    v5 = read(model_type="qwen3_moe", num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    assert v5.moe_layers == (0, 1, 2, 3) and v5.num_experts == 8
    mix = read(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert mix.moe_layers == (0, 1, 2, 3) and mix.norm_topk_prob and mix.moe_intermediate_size == 96


def test_windows_per_layer_from_layer_types_or_each_familys_rule():
    """transformers 5 lists ``layer_types``; transformers 4 configs leave each family's code to
    derive them (Qwen2/3 from max_window_layers, Gemma 2 the even layers, Gemma 3 by pattern)."""
    assert read(model_type="qwen2", sliding_window=1024, use_sliding_window=False).sliding_window is None
    qwen = read(model_type="qwen2", sliding_window=1024, use_sliding_window=True, max_window_layers=2)
    assert (qwen.sliding_window, qwen.window_layers) == (1024, (2, 3))
    assert [qwen.layer_window(i) for i in range(4)] == [None, None, 1024, 1024]
    kinds = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert read(model_type="qwen2", sliding_window=1024, use_sliding_window=True, layer_types=kinds) == qwen
    assert read(model_type="qwen3_moe", num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                sliding_window=1024, use_sliding_window=True).window_layers is None   # every layer
    assert read(model_type="gemma2", sliding_window=1024, head_dim=32).window_layers == (0, 2)
    assert read(model_type="gemma3_text", sliding_window=1024, sliding_window_pattern=2).window_layers == (0, 2)
    every = read(model_type="gemma3_text", sliding_window=1024)   # pattern 6: all four layers
    assert (every.sliding_window, every.window_layers) == (1024, None)
    assert read(model_type="mistral", sliding_window=4096).sliding_window is None   # = the context
    mistral = read(model_type="mistral", sliding_window=1024)
    assert (mistral.sliding_window, mistral.window_layers) == (1024, None)
    assert read(model_type="phi3", sliding_window=2047).layer_window(3) == 2047


def test_gemma_reads_its_layer_and_both_rope_spellings():
    new = read(model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=24, sliding_window=512,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = read(model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=24, sliding_window=512,
               rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert new == old
    assert (new.rope_theta, new.local_rope_theta, new.rope_scaling.rope_type) == (1e6, 1e4, "linear")
    assert new.qk_norm and new.sandwich_norms and new.norm_offset == 1.0 and new.tie_word_embeddings
    assert new.attn_scale == 24 ** -0.5 and new.embedding_multiplier == 8.0 and new.hidden_act == "gelu_tanh"
    g2 = read(model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert (g2.attn_softcap, g2.final_softcap, g2.qk_norm, g2.local_rope_theta) == (50.0, 30.0, False, None)


@pytest.mark.parametrize("fields, named", [
    ({"model_type": "gemma3"}, "model_type='gemma3'"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                       "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention"),
    ({"model_type": "gemma2", "layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ({"model_type": "mistral", "sliding_window": 1024, "layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "su", "factor": 2.0}}, "rope_type='su'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic"}}, "lacks factor"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
    ({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"model_type": "llama", "sliding_window": 1024}, "sliding_window=1024"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok=3"),
    ({"model_type": "qwen3_moe", "num_experts_per_tok": 2, "moe_intermediate_size": 8}, "'num_experts'"),
])
def test_what_is_not_implemented_or_missing_is_named(fields, named):
    with pytest.raises(ModelLoadError, match=named):
        read(**fields)


def test_a_missing_required_field_is_named():
    hf = {k: v for k, v in BASE.items() if k != "intermediate_size"}
    with pytest.raises(ModelLoadError, match="'intermediate_size'"):
        model_config_from_hf({**hf, "model_type": "llama"}, "m", "config.json")


PHI3 = {"model_type": "phi3", "partial_rotary_factor": 0.75, "max_position_embeddings": 512,
        "original_max_position_embeddings": 128}
SHORT, LONG = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [2.0, 2.0, 3.0, 3.0, 4.0, 4.0]   # rotary_dim 12 -> 6 each


def test_dynamic_rescales_past_max_position_embeddings_and_widens_the_context():
    """transformers' dynamic NTK rescales past ``max_position_embeddings`` (its "original"); the
    engine serves ``factor`` times that (as vLLM does), else the scaling would never apply."""
    old = read(model_type="llama", rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 4.0})
    new = read(model_type="llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    assert old == new
    assert new.rope_scaling == RopeScaling("dynamic", 4.0, original_max_position=4096)
    assert new.max_position == 4 * 4096


def test_longrope_reads_factors_and_derives_factor_from_the_two_contexts():
    old = read(**PHI3, rope_theta=1e4, rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    new = read(**PHI3, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": SHORT,
                                        "long_factor": LONG, "original_max_position_embeddings": 128})
    su = read(**PHI3, rope_theta=1e4, rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG})
    assert old == new == su   # Phi3Config reads the older "su" as longrope
    s = new.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position) == ("longrope", 4.0, 128)
    assert s.short_factor == tuple(SHORT) and s.long_factor == tuple(LONG)
    assert new.max_position == 512   # longrope's long context is max_position_embeddings itself
    given = read(**PHI3, rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                       "factor": 8.0, "attention_factor": 1.2})
    assert (given.rope_scaling.factor, given.rope_scaling.attention_factor) == (8.0, 1.2)


@pytest.mark.parametrize("rope, named", [
    ({"short_factor": SHORT}, "long_factor"),
    ({"long_factor": LONG}, "short_factor"),
    ({"short_factor": SHORT, "long_factor": LONG[:5]}, "long_factor has 5 values"),
    ({"short_factor": SHORT + [1.0], "long_factor": LONG}, "short_factor has 7 values"),
    ({"short_factor": SHORT, "long_factor": "2.0"}, "long_factor='2.0' must be a list"),
    ({"short_factor": SHORT, "long_factor": [0.0] * 6}, "long_factor must be > 0"),
])
def test_longrope_without_its_factors_or_with_the_wrong_count_is_refused(rope, named):
    with pytest.raises(ModelLoadError, match=named):
        read(**PHI3, rope_scaling={"type": "longrope", **rope})
