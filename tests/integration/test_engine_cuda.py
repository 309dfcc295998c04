"""The engine and a disaggregated pair on a GPU (cuda marker: skipped with the reason without one,
a failure under ``PDSERVE_REQUIRE=cuda``; ``python -m deploy.gpucheck`` runs this tier there).

Tiny checkpoints written by transformers as in `tests.integration.test_model_families` (weights
scaled so a wrong rope, norm or bias shows): Llama 3 (llama3 rope scaling, biases), Qwen2, and a
two-layer checkpoint of SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, 576 wide, tied
embeddings). On the GPU, against transformers on the same GPU:

- float32 (TF32 off on both sides): logits within 1e-4 of their scale (the largest |logit|) at
  every position of a 330-token prompt run in two chunks over the paged pool, and the 32 greedy
  tokens equal (a bound relative to the scale: the scaled weights amplify rounding).
- bfloat16 (weights and pool): against transformers' float32 logits, the engine's bf16 error is
  at most 2.5x transformers' own bf16 error, and its prompt argmax agrees with float32's at no
  fewer positions than transformers' bf16 does, less 0.1: on these checkpoints bf16 itself moves
  the logits by a large part of their scale, so two bf16 implementations cannot be held to each
  other directly. Why these bounds, and that a wrong rope theta fails them: docs/PERFORMANCE.md,
  "On a GPU (H200)".

Then a prefill and a decode worker (``--device cuda``, two processes on the one GPU) over each
transfer engine that moves GPU pools on one host (cuda_ipc; tcp and shm staged through host
mirrors) give the single-process engine's greedy tokens on that GPU, every block back in both
pools.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig, kv_cache_dtype
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.sampling import SamplingParams
from tests.integration.test_model_families import (BLOCK, FAMILIES, NEW_TOKENS, PROMPT_TOKENS, SPLIT, build_checkpoint,
                                                   prompt, save_tokenizer)
from tests.integration.worker_pair import serve_one
from tests.require import unavailable

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = [pytest.mark.integration, pytest.mark.cuda, pytest.mark.timeout(240)]

SMOLLM2_SHAPES = ("LlamaConfig", {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                  "num_key_value_heads": 3, "tie_word_embeddings": True},
                  {"rope_type": "default", "rope_theta": 100000.0})
CHECKPOINTS = {"llama3": FAMILIES["llama3"], "qwen2": FAMILIES["qwen2"], "smollm2-shapes": SMOLLM2_SHAPES}
BF16_ERROR_RATIO = 2.5


@pytest.fixture(scope="module", autouse=True)
def gpu():
    if not torch.cuda.is_available():
        unavailable("cuda", "no CUDA device: the engine's CUDA path cannot run here")
    torch.backends.cuda.matmul.allow_tf32 = False   # float32 means float32 on both sides
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer: from ``PDSERVE_TOKENIZER_DIR`` where set (the GPU machine has no
    GGUF: `deploy.gpucheck` carries the files), else saved from the GGUF."""
    given = os.environ.get("PDSERVE_TOKENIZER_DIR")
    out = tmp_path_factory.mktemp("tokenizer")
    if given:
        for f in Path(given).iterdir():
            shutil.copy(f, out / f.name)
        return out
    return save_tokenizer(out)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, tokenizer_dir) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir,
                            CHECKPOINTS[request.param])


@torch.inference_mode()
def reference(path: Path, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """transformers on the GPU: the prompt's logits and the greedy continuation."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
    ids = torch.tensor([prompt()], device="cuda")
    logits = model(ids).logits[0].float()
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, PROMPT_TOKENS:].tolist()
    return logits.cpu(), greedy


@torch.inference_mode()
def engine(path: Path, weights: str) -> tuple[torch.Tensor, list[int]]:
    """The engine on the GPU: the prompt's logits in two chunks over the paged pool, then one
    greedy token per pass."""
    loaded = load_model(path, weights=weights, device="cuda")
    ids, total = prompt(), PROMPT_TOKENS + NEW_TOKENS
    pool = KVPool(loaded.config, CacheConfig(block_size=BLOCK, num_blocks=-(-total // BLOCK) + 1,
                                             dtype=kv_cache_dtype(weights)), device=loaded.model.device)
    table = pool.allocator.allocate(-(-total // BLOCK))
    rows = [loaded.model.forward(ForwardBatch.build([SeqChunk(ids[a:b], a, table, prompt_logits=True)], BLOCK), pool)
            for a, b in ((0, SPLIT), (SPLIT, PROMPT_TOKENS))]
    logits = torch.cat(rows).float()
    tokens, pos = [int(logits[-1].argmax())], PROMPT_TOKENS
    while len(tokens) < NEW_TOKENS:
        out = loaded.model.forward(ForwardBatch.build([SeqChunk([tokens[-1]], pos, table)], BLOCK), pool)
        tokens.append(int(out[-1].argmax()))
        pos += 1
    return logits.cpu(), tokens


def test_fp32_on_the_gpu_equals_transformers(checkpoint):
    want_logits, want_tokens = reference(checkpoint, torch.float32)
    logits, tokens = engine(checkpoint, "fp32")
    scale = want_logits.abs().max().item()
    assert (logits - want_logits).abs().max().item() < 1e-4 * scale
    assert tokens == want_tokens


def test_bf16_on_the_gpu_is_within_its_tolerance(checkpoint):
    exact, _ = reference(checkpoint, torch.float32)
    theirs, _ = reference(checkpoint, torch.bfloat16)
    ours, _ = engine(checkpoint, "bf16")
    their_error, our_error = ((x - exact).abs().max().item() for x in (theirs, ours))
    agree = lambda x: (x.argmax(-1) == exact.argmax(-1)).float().mean().item()  # noqa: E731
    assert our_error <= BF16_ERROR_RATIO * their_error, (our_error, their_error)
    assert agree(ours) >= agree(theirs) - 0.1, (agree(ours), agree(theirs))


def test_decode_from_cuda_graphs_gives_the_eager_tokens(tmp_path, tokenizer_dir):
    """Three prompts of different lengths decoded greedily with decode steps replayed from CUDA
    graphs (`engine.cuda_graphs`: buckets of 1, 2, 4, 8; three sequences pad to 4, then fewer as
    they finish) give the eager engine's tokens on the same GPU."""
    from engine.loader import build_generator

    path = build_checkpoint("qwen2", tmp_path / "qwen2", tokenizer_dir, CHECKPOINTS["qwen2"])
    loaded = load_model(path, weights="fp32", device="cuda")
    ids = prompt()
    prompts = [ids[:40], ids[:150], ids[:7]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 16, 8)]
    eager = build_generator(loaded, CacheConfig(num_blocks=64))
    want = [eager.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    graphs = build_generator(loaded, CacheConfig(num_blocks=64))
    graphs.runner.enable_cuda_graphs(8)
    for i, (p, q) in enumerate(zip(prompts, params)):
        graphs.add_request(f"r{i}", p, q)
    got: dict[str, list[int]] = {}
    while graphs.has_unfinished():
        for out in graphs.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(3)] == want
    assert graphs.runner.graphs.replays >= 15


@pytest.mark.parametrize("transfer", ["cuda_ipc", "tcp", "shm", "auto"])
def test_two_gpu_workers_serve_the_engines_tokens(tmp_path, tokenizer_dir, transfer):
    path = build_checkpoint("qwen2", tmp_path / "qwen2", tokenizer_dir, CHECKPOINTS["qwen2"])
    _, want = engine(path, "fp32")
    flags = ("--model", str(path), "--weights", "fp32", "--device", "cuda", "--transfer-engine", transfer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert serve_one(flags, f"gpu-{transfer}", prompt(), params) == want

def test_pdserve_up_on_the_gpu_answers_as_the_engine(tmp_path, tokenizer_dir):
    """``pdserve up --device cuda`` (the launcher: router, a prefill and a decode worker as
    processes on the one GPU, ``auto``: cuda_ipc between their pools) answers greedy prompts with
    the single-process engine's text on that GPU."""
    import httpx

    from deploy.launcher import Cluster, LauncherConfig
    from engine.loader import build_generator

    path = build_checkpoint("qwen2", tmp_path / "qwen2", tokenizer_dir, CHECKPOINTS["qwen2"])
    loaded = load_model(path, weights="fp32", device="cuda")
    gen = build_generator(loaded, CacheConfig(num_blocks=64))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = {p: gen.generate([loaded.tokenizer.encode(p)], params)[0].text for p in prompts}
    del gen, loaded
    cluster = Cluster(LauncherConfig(model=str(path), weights="fp32", device="cuda", http_port=0, registry_port=0,
                                     num_blocks=256, log_dir=str(tmp_path / "logs"), startup_timeout_s=300)).start()
    try:
        model = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"][0]["id"]
        for p in prompts:
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                           json={"model": model, "prompt": p, "max_tokens": 16, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[p], p
    finally:
        cluster.stop()
    assert not [c.name for c in cluster.children if c.alive()]
