"""Every GGUF architecture the engine loads, against the same checkpoint as a Hugging Face directory.

Each family's tiny checkpoint (`tests.integration.test_model_families.build_checkpoint`: random
weights, norms and biases drawn, every feature the family has) is written as GGUF the way
llama.cpp's converter writes it (`tests.integration.gguf_convert`: metadata keys, tensor names,
Q/K permuted for ``llama`` only, experts stacked). The engine must read the GGUF into the
directory's `ModelConfig` and give the directory's logits within 1e-4 at every position of a
330-token prompt run in two chunks, and the same 32 greedy tokens; a Q8_0 file (the converter's
``--outtype q8_0``) gives, within 1e-4, the logits of the directory whose weights were rounded
to Q8_0. `test_a_wrong_permutation_choice_is_caught`
shows the comparison can fail; the rest show what is refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.loader import load_weights
from tests.integration.gguf_convert import T, rounded_like_q8_0, write_gguf
from tests.integration.test_model_families import FAMILIES, build_checkpoint, engine_logits_and_greedy, save_tokenizer

pytestmark = pytest.mark.integration

# the test_model_families checkpoints llama.cpp can write ("llama3": its rope factors as a
# rope_freqs tensor); "mistral-window" loses its window (the llama converter writes no
# sliding_window key)
GGUF_FAMILIES = ["llama", "llama3", "llama-linear", "llama-yarn", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe",
                 "gemma2", "gemma3"]
# llama.cpp's converter cannot write Qwen3-MoE's dense mlp_only_layers (gguf-py's QWEN3MOE
# tensors have no ffn_gate / ffn_up / ffn_down), so its GGUF checkpoint routes every layer
_cls, _fields, _rope = FAMILIES["qwen3_moe"]
SPECS = {"qwen3_moe": (_cls, {**_fields, "mlp_only_layers": []}, _rope)}
# Gemma: the converter writes no query_pre_attn_scalar (llama.cpp scales by head_dim ** -0.5) and
# no layer pattern (Gemma 3: every 6th layer global); Gemma2Model drops lm_head.weight (tied)
for _name, _more in (("gemma2", {"tie_word_embeddings": True}),
                     ("gemma3", {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})):
    _cls, _fields, _rope = FAMILIES[_name]
    SPECS[_name] = (_cls, {**_fields, "query_pre_attn_scalar": _fields["head_dim"], **_more}, _rope)
Q8_0_QUANTIZED, Q8_0_TOLERANCE = 1e-2, 10.0
"""Bounds of the largest |logit difference| between a Q8_0 file and its float32 checkpoint:
measured 3.9 (llama) and 5.9 (qwen3_moe) at the worst of 330 positions, median over positions
of the per-position maximum 0.3-0.7 (logits' std 2.4): these random untrained weights (std 0.3)
amplify rounding. Exactness is what `test_q8_0_gguf_equals_the_directory_of_its_rounded_weights`
checks, against the rounded weights; these bounds only say the file was quantized and sane."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory, its engine logits and greedy tokens), built once per module."""
    cache = {}
    tokenizer_dir = save_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))

    def get(family: str):
        if family not in cache:
            path = build_checkpoint(family, tmp_path_factory.mktemp(family), tokenizer_dir, SPECS.get(family))
            cache[family] = path, engine_logits_and_greedy(path)
        return cache[family]

    return get


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_gives_the_directory_config_logits_and_greedy_tokens(checkpoints, family, tmp_path):
    path, (want_logits, want_tokens) = checkpoints(family)
    gguf_file = write_gguf(path, tmp_path / f"{family}.gguf")
    cfg, _ = load_weights(gguf_file)
    want_cfg, _ = load_weights(path)
    # a GGUF cannot tell Mistral from Llama (llama.cpp writes both as llama)
    assert cfg == dataclasses.replace(want_cfg, name=cfg.name, architecture=cfg.architecture)
    assert cfg.architecture == {"mistral": "llama", "llama-linear": "llama", "llama-yarn": "llama"}.get(
        family, want_cfg.architecture)
    assert (family == "llama3") == (cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3")
    logits, tokens = engine_logits_and_greedy(gguf_file)
    err = (logits - want_logits).abs().max().item()
    assert err < 1e-4, f"{family}: logits differ by {err}"
    assert tokens == want_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_q8_0_gguf_equals_the_directory_of_its_rounded_weights(checkpoints, family, tmp_path):
    """The Q8_0 file gives the logits of the float checkpoint whose weights hold the Q8_0 values
    (within 1e-4: the blocks are decoded exactly), and is measurably off the unrounded one."""
    path, (want_logits, _) = checkpoints(family)
    gguf_file = write_gguf(path, tmp_path / "q8.gguf", qtype=T.Q8_0)
    logits, tokens = engine_logits_and_greedy(gguf_file)
    rounded_logits, rounded_tokens = engine_logits_and_greedy(rounded_like_q8_0(path, tmp_path / "rounded"))
    assert (logits - rounded_logits).abs().max().item() < 1e-4
    assert tokens == rounded_tokens
    err = (logits - want_logits).abs().max().item()
    assert Q8_0_QUANTIZED < err < Q8_0_TOLERANCE, f"{family}: Q8_0 logits off the float ones by {err}"


@pytest.mark.parametrize("family, permute", [("llama", False), ("qwen2", True)])
def test_a_wrong_permutation_choice_is_caught(checkpoints, family, permute, tmp_path):
    """Q/K left unpermuted for llama (or permuted for NEOX-rope qwen2) changes the logits."""
    path, (want_logits, _) = checkpoints(family)
    gguf_file = write_gguf(path, tmp_path / "wrong.gguf", permute_qk=permute)
    logits, _ = engine_logits_and_greedy(gguf_file)
    assert (logits - want_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("change, match", [
    (dict(arch_name="gpt2"), "general.architecture='gpt2'"),
    (dict(extra_kv={"qwen3.rope.scaling.type": "longrope"}), "qwen3.rope.scaling.type='longrope'"),
    (dict(extra_kv={"qwen3.attention.sliding_window": 64}), "qwen3.attention.sliding_window=64"),
    (dict(extra_kv={"qwen3.logit_scale": 2.0}), "qwen3.logit_scale=2.0"),
    (dict(extra_tensors={"blk.0.attn_output.lora_a": np.zeros((4, 128), np.float32)}), "attn_output.lora_a"),
])
def test_what_the_engine_does_not_implement_is_refused_with_the_key_named(checkpoints, change, match, tmp_path):
    path, _ = checkpoints("qwen3")
    bad = write_gguf(path, tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=match):
        load_weights(bad)


def test_rope_factors_that_are_not_llama3_are_refused(checkpoints, tmp_path):
    """Llama 3's rope scaling reaches GGUF as a ``rope_freqs`` tensor (``generate_extra_tensors``);
    a table no llama3 parameters reproduce (six different band divisors) is refused."""
    path, _ = checkpoints("llama")
    factors = np.linspace(1, 3, 8, dtype=np.float32)
    bad = write_gguf(path, tmp_path / "odd.gguf", extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_weights(bad)
