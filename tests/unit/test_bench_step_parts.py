"""`bench.step_parts`: every part of a pass is timed inside it, the parts add up to no more than the
pass, the wrappers come off (the model's outputs and attributes are as before), and the blocks
return to the pool."""

from __future__ import annotations

import pytest

import torch

import engine.models.llama as llama
from bench.step_parts import PROJECTIONS, PartTimers, table, time_parts
from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.glue import CompiledGlue
from engine.kv_cache import KVPool
from engine.runner import ModelRunner
from tests.unit.test_engine_runner import TINY, _model

pytestmark = pytest.mark.unit


def test_parts_are_timed_inside_the_pass_and_blocks_return():
    model, pool = _model(), KVPool(TINY, CacheConfig(block_size=4, num_blocks=64))
    result = time_parts(ModelRunner(model, pool), pool, reps=2, context=9, rows=(1, 3))
    assert list(result) == ["decode x1", "prefill 9", "decode x3"]
    for kind, r in result.items():
        parts = r["parts_ms"]
        assert {*PROJECTIONS, "head", "attention", "store_kv", "rms_norm"} <= set(parts), kind
        assert all(ms > 0 for ms in parts.values())
        assert 0 < sum(parts.values()) <= r["pass_ms"] and r["rest_ms"] >= 0
    assert pool.allocator.num_free == 64
    text = table(result)
    assert text.splitlines()[0] == "| part | decode x1 | prefill 9 | decode x3 |"
    assert "| rest |" in text and "| attention |" in text


def test_the_wrappers_come_off_and_the_pass_is_unchanged():
    model, pool = _model(), KVPool(TINY, CacheConfig(block_size=4, num_blocks=64))
    before = (vars(model._layers[0]).copy(), model._lm_head, llama.paged_attention, llama.store_kv,
              llama._rms_norm)
    blocks = pool.allocator.allocate(3)
    batch = ForwardBatch.build([SeqChunk(list(range(1, 10)), 0, blocks)], pool.block_size)
    reference = model.forward(batch, pool)
    with PartTimers(model) as timers:
        assert llama.paged_attention is not before[2]
        timed = model.forward(batch, pool)
        assert timers.calls["wqkv"] == TINY.num_layers and timers.calls["attention"] == TINY.num_layers
        assert timers.calls["head"] == 1
    torch.testing.assert_close(timed, reference, rtol=0, atol=0)
    after = (vars(model._layers[0]).copy(), model._lm_head, llama.paged_attention, llama.store_kv,
             llama._rms_norm)
    assert after == before
    pool.allocator.free(blocks)


def test_a_wrapper_failing_inside_still_comes_off():
    model = _model()
    model.glue = CompiledGlue()   # its methods are the class's: wrapped on the instance, then removed
    kept = llama.paged_attention
    with pytest.raises(RuntimeError, match="inside"):
        with PartTimers(model):
            assert "rope_split" in vars(model.glue)
            raise RuntimeError("inside")
    assert llama.paged_attention is kept and "wqkv" in vars(model._layers[0])
    assert not {"rope_split", "add_norm", "silu_mul"} & set(vars(model.glue))


def test_only_a_llama_model_is_taken():
    with pytest.raises(TypeError, match="LlamaModel"):
        PartTimers(object())
