"""The compiled forward (`engine.compiled`) against the eager one on the same weights: prompt
passes, one-sequence and batched decode, prompt logits, and the per-layer hook, through the
custom operators and inductor's generated code (on the CPU: C++ built at the first passes)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.compiled import PassContext, attention
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from tests.unit.test_engine_runner import TINY, _model

pytestmark = pytest.mark.integration
BS = 4


def _pool() -> KVPool:
    return KVPool(TINY, CacheConfig(block_size=BS, num_blocks=64))


@pytest.fixture(scope="module")
def models():
    eager, compiled = _model(), _model()
    compiled._compile()
    return eager, compiled


def test_compiled_passes_equal_eager_ones_and_write_the_same_kv(models):
    eager, compiled = models
    pools = _pool(), _pool()
    tables = [pools[0].allocator.allocate(8) for _ in range(2)]
    for p in pools[1:]:
        assert [p.allocator.allocate(8) for _ in range(2)] == tables
    prompts = [list(range(1, 19)), list(range(30, 41))]
    passes = [
        [SeqChunk(prompts[0], 0, tables[0], prompt_logits=True)],   # every row's logits
        [SeqChunk(prompts[1], 0, tables[1])],
    ]
    last = [int(p[-1]) for p in prompts]
    for step in range(3):   # both sequences decode together (two rows), then the first alone
        passes.append([SeqChunk([last[0] + step], 18 + step, tables[0]),
                       SeqChunk([last[1] + step], 11 + step, tables[1])])
    passes.append([SeqChunk([7], 21, tables[0])])
    for chunks in passes:
        batch = ForwardBatch.build(chunks, BS)
        hooks = []
        got = compiled.forward(batch, pools[1], on_layer_done=hooks.append)
        want = eager.forward(batch, pools[0])
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert hooks == list(range(TINY.num_layers))
    assert (pools[1].kv - pools[0].kv).abs().max().item() < 1e-5


def test_the_attention_operator_refuses_to_run_outside_a_pass():
    q = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="outside a PassContext"):
        attention(q, q[:, :2], q[:, :2], 0)
    with PassContext(lambda q, k, v, layer: q.reshape(q.shape[0], -1) + layer):
        assert attention(q, q[:, :2], q[:, :2], 3).eq(3).all()


def test_warm_up_builds_the_graphs_and_gives_its_blocks_back(models):
    eager, compiled = models
    pool = _pool()
    assert eager.warm_up(pool) == 0.0
    assert compiled.warm_up(pool) > 0.0
    assert pool.allocator.num_free == pool.num_blocks
    pool.allocator.allocate(pool.num_blocks - 1)
    with pytest.raises(ValueError, match="2 free KV blocks"):
        compiled.warm_up(pool)
