"""`bench.perplexity`: llama-perplexity's protocol, checked against transformers' log-likelihoods."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from bench.perplexity import DEFAULT_TEXT, chunk_nll, chunks_of, llama_cpp_perplexity, main, perplexity
from engine.config import CacheConfig
from engine.kv_cache import KVPool

pytestmark = pytest.mark.integration

TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the budget. "
        "Rivers carry sediment to the sea, and the tides sort it into sand and mud. ") * 20


def test_chunks_follow_llama_cpp():
    tokens = list(range(1000))
    parts = chunks_of(tokens, 256, None)
    assert [p[0] for p in parts] == [0, 256, 512] and all(len(p) == 256 for p in parts)
    assert len(chunks_of(tokens, 256, 2)) == 2
    with pytest.raises(ValueError, match="needs >= 1024"):
        chunks_of(tokens[:1000], 512, None)


@torch.inference_mode()
def test_fp32_chunk_nll_equals_transformers(smollm, hf_model):
    ids = smollm.tokenizer.encode(TEXT)[:128]
    pool = KVPool(smollm.config, CacheConfig(num_blocks=8, dtype=smollm.kv_dtype))
    nll, count = chunk_nll(smollm, pool, ids, bos=None)
    assert count == 63 and pool.allocator.num_free == 8   # second half scored; blocks returned
    logits = hf_model(torch.tensor([ids])).logits[0, 64:127].float()
    ref = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[65:])[:, None]).double().sum()
    assert nll == pytest.approx(float(ref), rel=1e-4)


def test_native_weights_perplexity_is_within_one_percent_of_fp32(smollm):
    from engine.loader import load_model

    native = load_model(weights="native")
    tokens = smollm.tokenizer.encode(TEXT)
    fp32 = perplexity(smollm, tokens, 128, 4)
    nat = perplexity(native, tokens, 128, 4)
    assert fp32["chunks"] == nat["chunks"] == 4 and fp32["tokens_scored"] == 4 * 63
    assert 1.0 < fp32["ppl"] < 50.0 and math.isfinite(nat["ppl"])
    assert abs(nat["ppl"] / fp32["ppl"] - 1) < 0.01


def test_cli_refuses_a_missing_text_file(tmp_path, capsys):
    assert main(["--text", str(tmp_path / "none.txt"), "--weights", "fp32"]) == 2
    assert "no text file" in capsys.readouterr().err


def test_llama_cpp_runner_reports_a_failing_binary(tmp_path):
    bad = tmp_path / "llama-perplexity"
    bad.write_text("#!/bin/sh\necho 'model not found' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match="model not found"):
        llama_cpp_perplexity(str(bad), tmp_path / "m.gguf", DEFAULT_TEXT, 512, 2)
    assert shutil.which("sh")
