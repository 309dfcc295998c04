"""KV between tensor-parallel groups of different sizes (`worker.tp_rank`, `kvtransfer.tp`), in
process over the tcp data plane: prefill workers at TP 1, 2 and 4 and decode workers at TP 1, 2
and 4 of a tiny Qwen2 checkpoint (8 query heads, 4 KV heads, weights scaled as in
`tests.integration.test_model_families`), each rank its own endpoint. For (prefill TP, decode TP)
= (1,1), (2,1), (1,2), (2,4) and (4,2), every prefill rank writes its heads straight into the decode
ranks that hold them; the decode side counts every rank's immediates against the plan's total;
greedy tokens equal the TP-1 engine's, and every block returns to both pools.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from decode.arrivals import DecodeArrivals
from decode.server import NUM_TRANSFER_SLOTS
from decode.worker import DecodeWorker
from engine.config import CacheConfig
from engine.loader import build_generator, load_model
from engine.sampling import SamplingParams
from prefill.worker import PrefillWorker
from tests.integration.test_delta_transfer import decode_all
from tests.integration.test_model_families import build_checkpoint, save_tokenizer
from tests.integration.test_tensor_parallel import CHECKPOINTS
from worker.config import WorkerConfig
from worker.runtime import build_resources

pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SIZES = (1, 2, 4)
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)]
BS = 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(300, 300 + n)) for n in (5, 40, 97)]   # a partial block; 3 blocks; 7 blocks


def _config(role: str, path, tp: int, **kw) -> WorkerConfig:
    return WorkerConfig(role=role, model=str(path), weights="fp32", transfer_engine="tcp", num_blocks=64,
                        block_size=BS, tensor_parallel_size=tp, threads=1, **kw)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    tok = save_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return build_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), tok, CHECKPOINTS["qwen2"])


@pytest.fixture(scope="module")
def reference(qwen2):
    loaded = load_model(qwen2, weights="fp32")
    gen = build_generator(loaded, CacheConfig(block_size=BS, num_blocks=64))
    return {tuple(p): gen.generate([p], PARAMS)[0].token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def groups(qwen2):
    """Prefill and decode workers at each of `SIZES`, every prefill worker connected to every
    decode worker ("d<tp>"); all closed on exit, their rank processes checked gone."""
    with contextlib.ExitStack() as stack:
        decode, prefill = {}, {}
        for tp in SIZES:
            arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
            res = build_resources(_config("decode", qwen2, tp), arrivals)
            stack.callback(res.close)
            decode[tp] = DecodeWorker(res, arrivals)
            stack.callback(decode[tp].close)
        for tp in SIZES:
            res = build_resources(_config("prefill", qwen2, tp))
            stack.callback(res.close)
            prefill[tp] = PrefillWorker(res)
            stack.callback(prefill[tp].close)
            for dtp, d in decode.items():
                prefill[tp].connect(f"d{dtp}", d.res.endpoint())
        ranks = [p for w in (*decode.values(), *prefill.values()) for p in getattr(w.res.loaded.model, "ranks", [])]
        assert len(ranks) == 2 * sum(tp - 1 for tp in SIZES)
        yield prefill, decode
    assert all(p.poll() is not None for p in ranks)


def _serve(prefill: PrefillWorker, decode: DecodeWorker, dst: str, rid: str, prompt: list[int]):
    r = decode.reserve(rid, len(prompt), PARAMS.max_tokens, prompt)
    job = prefill.submit(rid, prompt, PARAMS, dst, r.blocks, r.transfer.slot, r.transfer.generation)
    return r, job


@pytest.mark.parametrize("a,b", PAIRS)
def test_kv_between_tp_sizes_decodes_the_tp1_tokens(groups, reference, a, b):
    prefill, decode = groups[0][a], groups[1][b]
    started = [_serve(prefill, decode, f"d{b}", f"r{a}{b}-{i}", p) for i, p in enumerate(PROMPTS)]   # one pass
    layout = decode.res.layout
    for (r, job), p in zip(started, PROMPTS):
        assert job.finished.wait(120)
        res = job.result()
        # one write per (layer, K|V, KV head) of the model: the blocks are one run on both sides
        assert res.num_writes == 2 * layout.num_layers * 4
        assert res.bytes_written == -(-len(p) // BS) * layout.bytes_per_block // layout.num_kv_heads * 4
        assert decode_all(decode, r.request_id, res, p, PARAMS) == reference[tuple(p)], (a, b, len(p))
    deadline = time.monotonic() + 10
    while prefill.res.pool.allocator.num_free < prefill.res.pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.res.pool.allocator.num_free == prefill.res.pool.num_blocks
    assert decode.res.pool.allocator.num_free == decode.res.pool.num_blocks
