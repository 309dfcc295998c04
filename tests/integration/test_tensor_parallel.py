"""Tensor parallelism in the engine (`engine.tp`, `engine.tp_ranks`): a model sharded over 2, 3 or
4 rank processes computes what the unsharded model computes.

Tiny checkpoints written by transformers (as `tests.integration.test_model_families` writes them:
weights scaled to 0.3, norms and biases drawn) with 8 query heads: Qwen2 with 4 KV heads (Q/K/V
biases sharded with their rows; a vocabulary of 49157 rows, so the last rank's share is shorter),
Llama with 2 KV heads at TP 4 (each KV head replicated on two ranks), Qwen3-MoE at TP 2 (one
dense layer, one of experts split across the ranks). Each must give the TP-1 logits within 1e-5 of
their scale (the largest |logit|, ~20 here) at every position of a 330-token prompt run in two
chunks over a paged pool, and its 32 greedy tokens. Relative, since O's and down's dot products are
summed in another order (each rank's partial sum, then the all-reduce): 3e-6 of the scale here,
5e-5 absolute, the float32 rounding of that reorder;
`test_the_comparison_catches_a_1pct_rope_theta_change` shows the tolerance bites. SmolLM2 (3 KV
heads) runs at TP 3. The rank processes are stopped by ``close``, and a rank killed with SIGKILL
fails the next pass with a typed error, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig, SchedulerConfig
from engine.errors import ModelLoadError, TensorParallelError
from engine.loader import build_generator, load_model, make_pool
from engine.sampling import SamplingParams
from tests.integration.test_model_families import (BLOCK, NEW_TOKENS, PROMPT_TOKENS, SPLIT, build_checkpoint,
                                                   prompt, save_tokenizer, with_config)

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = pytest.mark.integration

TINY = dict(hidden_size=128, num_attention_heads=8, head_dim=16, intermediate_size=96)
CHECKPOINTS = {
    "qwen2": ("Qwen2Config", {**TINY, "num_key_value_heads": 4, "vocab_size": 49157},
              {"rope_type": "default", "rope_theta": 1e6}),
    "llama-kv2": ("LlamaConfig", {**TINY, "num_key_value_heads": 2}, {"rope_type": "default", "rope_theta": 1e4}),
    "qwen3_moe": ("Qwen3MoeConfig", {**TINY, "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0]},
                  {"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tok = save_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return {name: build_checkpoint(name, tmp_path_factory.mktemp(name), tok, spec)
            for name, spec in CHECKPOINTS.items()}


@torch.inference_mode()
def logits_and_greedy(path: Path, tp: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits (two chunks over a paged pool) and 32 greedy tokens, at TP ``tp``."""
    loaded = load_model(path, weights="fp32", tensor_parallel_size=tp, threads=1)
    try:
        ids, total = prompt(), PROMPT_TOKENS + NEW_TOKENS
        pool = make_pool(loaded, CacheConfig(block_size=BLOCK, num_blocks=-(-total // BLOCK) + 1))
        table = pool.allocator.allocate(-(-total // BLOCK))
        rows = [loaded.model.forward(ForwardBatch.build([SeqChunk(ids[a:b], a, table, prompt_logits=True)], BLOCK), pool)
                for a, b in ((0, SPLIT), (SPLIT, PROMPT_TOKENS))]
        logits = torch.cat(rows)
        tokens, pos = [int(logits[-1].argmax())], PROMPT_TOKENS
        while len(tokens) < NEW_TOKENS:
            out = loaded.model.forward(ForwardBatch.build([SeqChunk([tokens[-1]], pos, table)], BLOCK), pool)
            tokens.append(int(out[-1].argmax()))
            pos += 1
        return logits, tokens
    finally:
        close = getattr(loaded.model, "close", None)
        if close is not None:
            close()


@pytest.mark.parametrize("name,sizes", [("qwen2", (2, 4)), ("llama-kv2", (4,)), ("qwen3_moe", (2,))])
def test_sharded_logits_and_greedy_tokens_equal_tp1(checkpoints, name, sizes):
    ref_logits, ref_tokens = logits_and_greedy(checkpoints[name], 1)
    assert ref_logits.shape == (PROMPT_TOKENS, CHECKPOINTS[name][1].get("vocab_size", 49152))
    for tp in sizes:
        logits, tokens = logits_and_greedy(checkpoints[name], tp)
        assert logits.shape == ref_logits.shape
        assert (logits - ref_logits).abs().max().item() < 1e-5 * ref_logits.abs().max().item(), (name, tp)
        assert tokens == ref_tokens, (name, tp)


def test_the_comparison_catches_a_1pct_rope_theta_change(checkpoints, tmp_path):
    """The 1e-5 tolerance above is not vacuous: the same model with its rope base 1% off, at TP 2,
    is far outside it."""
    ref_logits, _ = logits_and_greedy(checkpoints["qwen2"], 1)
    off = with_config(checkpoints["qwen2"], tmp_path / "off", rope_parameters={"rope_theta": 1.01e6})
    logits, _ = logits_and_greedy(off, 2)
    assert (logits - ref_logits).abs().max().item() > 1e-2 * ref_logits.abs().max().item()


def test_smollm2_at_tp3_answers_as_tp1():
    """SmolLM2-135M (9 query heads, 3 KV heads) over 3 ranks, served by the generator: the same
    greedy answers as one process, two choices each (n=2 forks the prompt's partial block on every
    rank)."""
    prompts = ["What is the capital of France?", "Name three colors."]
    params = SamplingParams(max_tokens=24, temperature=0.0, n=2)

    def answers(tp: int) -> dict:
        loaded = load_model(None, weights="fp32", tensor_parallel_size=tp, threads=1)
        try:
            gen = build_generator(loaded, CacheConfig(num_blocks=64), SchedulerConfig())
            for i, p in enumerate(prompts):
                ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                gen.add_request(f"r{i}", ids, params)
            texts: dict = {}
            while gen.has_unfinished():
                for out in gen.step():
                    texts[out.request_id, out.index] = texts.get((out.request_id, out.index), "") + out.text_delta
            return texts
        finally:
            if tp > 1:
                loaded.model.close()

    ref = answers(1)
    assert len(ref) == 4 and "Paris" in ref["r0", 0]
    assert answers(3) == ref


def test_a_tp_size_the_model_cannot_split_is_refused_naming_the_field(checkpoints):
    with pytest.raises(ModelLoadError, match="num_heads=8 is not divisible by tensor parallel size 3"):
        load_model(checkpoints["qwen2"], weights="fp32", tensor_parallel_size=3)


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_close_stops_the_ranks_and_a_killed_rank_fails_the_next_pass(checkpoints, monkeypatch):
    from engine import tp_ranks

    path = checkpoints["qwen2"]
    loaded = load_model(path, weights="fp32", tensor_parallel_size=2, threads=1)
    ranks = list(loaded.model.ranks)
    assert [_comm(p.pid) for p in ranks] == ["pdserve-tp-r1"]
    loaded.model.close()
    assert [p.returncode for p in ranks] == [0]

    loaded = load_model(path, weights="fp32", tensor_parallel_size=4, threads=1)
    pool = make_pool(loaded, CacheConfig(block_size=BLOCK, num_blocks=8))
    table = pool.allocator.allocate(2)
    batch = ForwardBatch.build([SeqChunk(list(range(100, 120)), 0, table)], BLOCK)
    loaded.model.forward(batch, pool)
    victim = loaded.model.ranks[1]
    real_reap = tp_ranks._reap

    def slow_reap(ranks, timeout_s):   # a fault injected: the ranks left outlive the loss a while
        time.sleep(0.5)
        real_reap(ranks, timeout_s)

    monkeypatch.setattr(tp_ranks, "_reap", slow_reap)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    # the rank's events thread finds the group lost before a pass does (as in a CI run): the
    # ranks left must be gone once the group says it is lost
    deadline = time.monotonic() + 10
    while loaded.model.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(TensorParallelError, match="rank 2 exit code -9"):
        loaded.model.forward(batch, pool)
    assert all(p.poll() is not None for p in loaded.model.ranks)   # the group goes as a whole
    with pytest.raises(TensorParallelError):
        loaded.model.forward(batch, pool)
    loaded.model.close()


def test_ranks_exit_when_rank_0_dies(checkpoints):
    """Rank 0 killed with SIGKILL: its followers notice (their parent is gone) and exit."""
    code = (f"from engine.loader import load_model; import sys, time; "
            f"m = load_model({str(checkpoints['qwen2'])!r}, weights='fp32', tensor_parallel_size=2, threads=1).model; "
            "print(m.ranks[0].pid, flush=True); time.sleep(600)")
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        follower = int(rank0.stdout.readline())
        assert _comm(follower) == "pdserve-tp-r1"
        rank0.kill()
        rank0.wait(10)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{follower}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{follower}").exists() or "Z" in Path(f"/proc/{follower}/stat").read_text().split()[2]
    finally:
        rank0.kill()


def test_a_pass_failing_on_rank_0_alone_gives_the_group_up_instead_of_hanging(checkpoints):
    """Rank 0's per-layer hook raises mid-pass (the prefill worker posts its writes from it): the
    other ranks wait in the next all-reduce, so the group is given up (ranks killed, a typed error)
    rather than left out of step."""
    loaded = load_model(checkpoints["qwen2"], weights="fp32", tensor_parallel_size=2, threads=1)
    pool = make_pool(loaded, CacheConfig(block_size=BLOCK, num_blocks=8))
    batch = ForwardBatch.build([SeqChunk(list(range(100, 120)), 0, pool.allocator.allocate(2))], BLOCK)

    def hook(layer: int) -> None:
        if layer == 1:
            raise OSError("the NIC is gone")

    with pytest.raises(TensorParallelError, match="OSError: the NIC is gone"):
        loaded.model.forward(batch, pool, hook)
    assert all(p.poll() is not None for p in loaded.model.ranks)
    with pytest.raises(TensorParallelError):
        loaded.model.forward(batch, pool)
    loaded.model.close()
