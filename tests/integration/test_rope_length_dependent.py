"""The rope types whose frequencies depend on the sequence's length (``dynamic``, ``longrope``),
against transformers on tiny checkpoints it wrote (the helpers of test_model_families.py).

transformers picks these frequencies per forward call from the length that call sees
(``dynamic_rope_update``) and keeps K in its cache as rotated then; the engine does the same per
sequence (`engine.models.rope.RotaryEmbedding`). So the reference is transformers fed the prompt
in the engine's chunks with a cache, then one token at a time: the first chunk (100 tokens)
stays within the original context of 128 (unscaled base / ``short_factor``), the second (to 330)
and every decode step go past it (rescaled base / ``long_factor``). Logits within 1e-4 at every
prompt position and the 32 greedy tokens must match, in both config spellings; a factor or theta
1% off must fall outside that; and two sequences batched together, one within the original
context and one past it, must each get what it gets alone (a per-batch choice would rotate the
short one with the long one's frequencies).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.runner import ModelRunner
from engine.tokenizer import Tokenizer
from tests.integration import test_model_families as families
from worker.config import WorkerConfig
from worker.runtime import build_resources

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = pytest.mark.integration

tokenizer_dir = families.tokenizer_dir
PROMPT, NEW, BLOCK = families.PROMPT_TOKENS, families.NEW_TOKENS, families.BLOCK
CHUNKS = ((0, 100), (100, PROMPT))   # the first within the original context (128), the second past it
_gen = torch.Generator().manual_seed(3)
SHORT = [round(v, 4) for v in (1 + 3 * torch.rand(6, generator=_gen)).tolist()]   # rotary_dim 12 -> 6
LONG = [round(v, 4) for v in (1 + 3 * torch.rand(6, generator=_gen)).tolist()]

# name: (config class, config fields, rope parameters as transformers 5 writes them)
CHECKPOINTS = {
    "llama-dynamic": ("LlamaConfig", {"max_position_embeddings": 128},
                      {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
    "phi3-longrope": ("Phi3Config", {"pad_token_id": 0, "sliding_window": None, "max_position_embeddings": 512,
                                     "original_max_position_embeddings": 128},
                      {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                       "short_factor": SHORT, "long_factor": LONG}),
}


def build(name: str, out: Path, tokenizer: Path) -> Path:
    """``name``'s checkpoint, written as `families.build_checkpoint` writes a family's."""
    cls, fields, rope = CHECKPOINTS[name]
    config = getattr(transformers, cls)(**{**families.BASE, **fields}, rope_parameters=dict(rope))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    families._randomize(model, 1)
    model.save_pretrained(out)
    for f in tokenizer.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@torch.inference_mode()
def hf_chunked(path: Path) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits ``[PROMPT, vocab]`` over the prompt fed in `CHUNKS` with a cache,
    and its greedy continuation fed one token per call (a fresh model: dynamic's state is its)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids, cache, rows = torch.tensor([families.prompt()]), None, []
    for start, end in CHUNKS:
        out = model(ids[:, start:end], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0])
    tokens = [int(rows[-1][-1].argmax())]
    while len(tokens) < NEW:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return torch.cat(rows), tokens


def hf_one_pass(path: Path) -> torch.Tensor:
    with torch.inference_mode():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return model(torch.tensor([families.prompt()])).logits[0]


class EngineSeq:
    """One sequence on the engine: its block table in a shared pool, its tokens, its length."""

    def __init__(self, pool: KVPool, ids: list[int]):
        self.ids, self.table = ids, pool.allocator.allocate(-(-(PROMPT + NEW) // BLOCK))

    def chunk(self, start: int, end: int, prompt_logits: bool = True) -> SeqChunk:
        return SeqChunk(self.ids[start:end], start, self.table, prompt_logits=prompt_logits)


def engine_pool(loaded, sequences: int = 1) -> KVPool:
    blocks = sequences * -(-(PROMPT + NEW) // BLOCK) + 1
    return KVPool(loaded.config, CacheConfig(block_size=BLOCK, num_blocks=blocks))


@torch.inference_mode()
def engine_chunked(path: Path) -> tuple[torch.Tensor, list[int]]:
    """The engine's prompt logits over `CHUNKS` and its greedy continuation, one sequence."""
    return families.engine_logits_and_greedy(path, CHUNKS)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, tokenizer_dir):
    name = request.param
    path = build(name, tmp_path_factory.mktemp(name), tokenizer_dir)
    return name, path, hf_chunked(path)


def _spelled(path: Path, spelling: str, tmp: Path) -> Path:
    if spelling == "transformers5":
        return path
    old = families.as_transformers4(path, tmp / "t4")
    if spelling == "transformers4-rope_type":   # rope_scaling with "rope_type" in place of "type"
        cfg = json.loads((old / "config.json").read_text())
        cfg["rope_scaling"]["rope_type"] = cfg["rope_scaling"].pop("type")
        (old / "config.json").write_text(json.dumps(cfg))
    return old


@pytest.mark.parametrize("spelling", ["transformers5", "transformers4", "transformers4-rope_type"])
def test_chunked_logits_and_greedy_tokens_equal_transformers_fed_the_same_chunks(checkpoint, spelling, tmp_path):
    name, path, (want_logits, want_tokens) = checkpoint
    logits, tokens = engine_chunked(_spelled(path, spelling, tmp_path))
    assert logits.shape == want_logits.shape
    err = (logits - want_logits).abs().max().item()
    assert err < 1e-4, f"{name}: logits differ by {err}"
    assert tokens == want_tokens


def test_the_router_and_the_engine_serve_one_context(checkpoint):
    """dynamic serves ``factor * max_position_embeddings`` (512 here), longrope
    ``max_position_embeddings``; the tokenizer's context (what the router checks requests
    against) says the same as the model's."""
    name, path, _ = checkpoint
    context = load_model(path, weights="fp32").config.max_position
    assert context == 512 and Tokenizer.from_file(path).context_length == context


def _one_percent_off(name: str) -> list[dict]:
    """Config changes, each 1% off in one number the rotation depends on."""
    rope = CHECKPOINTS[name][2]
    if name == "llama-dynamic":
        return [{"rope_theta": rope["rope_theta"] * 1.01}, {"factor": rope["factor"] * 1.01}]
    return [{"rope_theta": rope["rope_theta"] * 1.01},
            {"short_factor": [v * 1.01 for v in SHORT]}, {"long_factor": [v * 1.01 for v in LONG]}]


def test_a_1pct_factor_or_theta_change_is_caught(checkpoint, tmp_path):
    """The comparison above fails with theta, dynamic's factor or either of longrope's factor
    lists 1% off (each list on the rows its chunk rotates with it); and against transformers run
    over the whole prompt in one call (every position rotated for 330 tokens), the engine's
    first chunk differs: the reference must be chunked as the engine runs."""
    name, path, (want_logits, _) = checkpoint
    first = slice(0, CHUNKS[0][1])
    for i, change in enumerate(_one_percent_off(name)):
        wrong = families.with_config(path, tmp_path / f"wrong{i}", rope_parameters=change)
        logits, _ = engine_chunked(wrong)
        err = (logits - want_logits).abs().max().item()
        assert err > 1e-3, f"{name}: {change} off by 1% moves the logits by only {err}"
        if "short_factor" in change or "long_factor" in change:   # only the rows of its own chunk
            rows_off = (logits[first] - want_logits[first]).abs().max().item()
            assert (rows_off > 1e-3) == ("short_factor" in change), (change, rows_off)
    one_pass = hf_one_pass(path)
    assert (one_pass[first] - want_logits[first]).abs().max().item() > 1e-3


@torch.inference_mode()
def test_each_sequence_of_a_batch_is_rotated_for_its_own_length(checkpoint):
    """Sequence A (the prompt's first 100 tokens, within the original context) prefilled in the
    same pass as sequence B's second chunk (to 330, past it), then both decoding together: A's
    logits are transformers' for A alone, and B's logits and greedy tokens are B's alone."""
    name, path, (want_logits, want_tokens) = checkpoint
    loaded = load_model(path, weights="fp32")
    pool = engine_pool(loaded, sequences=2)
    a, b = EngineSeq(pool, families.prompt()[:CHUNKS[0][1]]), EngineSeq(pool, families.prompt())
    loaded.model.forward(ForwardBatch.build([b.chunk(*CHUNKS[0], prompt_logits=False)], BLOCK), pool)
    both = ForwardBatch.build([a.chunk(*CHUNKS[0]), b.chunk(*CHUNKS[1])], BLOCK)
    logits = loaded.model.forward(both, pool)
    split = CHUNKS[0][1]
    for got, want, who in ((logits[:split], want_logits[:split], "A"), (logits[split:], want_logits[split:], "B")):
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{name}: sequence {who}'s logits differ by {err} when batched"
    last_a, tokens = int(logits[split - 1].argmax()), [int(logits[-1].argmax())]
    for step in range(NEW - 1):
        batch = ForwardBatch.build([SeqChunk([last_a], split + step, a.table),
                                    SeqChunk([tokens[-1]], PROMPT + step, b.table)], BLOCK)
        out = loaded.model.forward(batch, pool)
        last_a = int(out[0].argmax())
        tokens.append(int(out[1].argmax()))
    assert tokens == want_tokens


def test_a_worker_turns_prefix_caching_off_for_it_and_logs_why(checkpoint, caplog):
    """The runner refuses prefix caching for these rope types; a worker asked for it (as ``pdserve
    up`` asks by default) serves without, and its log says why."""
    name, path, _ = checkpoint
    loaded = load_model(path, weights="fp32")
    with pytest.raises(ValueError, match="prefix caching cannot serve"):
        ModelRunner(loaded.model, engine_pool(loaded), prefix_caching=True)
    config = WorkerConfig(role="prefill", model=str(path), weights="auto", prefix_caching=True,
                          transfer_engine="tcp", num_blocks=64)   # auto: the mode ``loaded`` has
    with caplog.at_level(logging.WARNING, logger="worker.runtime"):
        res = build_resources(config, loaded=loaded)
    try:
        assert res.config.prefix_caching is False
        assert res.config.weights == "fp32"
        assert "prefix caching turned off" in caplog.text
        assert CHECKPOINTS[name][2]["rope_type"] in caplog.text
    finally:
        res.close()
