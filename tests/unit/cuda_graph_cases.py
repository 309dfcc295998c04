"""`engine.cuda_graphs.DecodeGraphs` without capture on the CPU, under ``TRITON_INTERPRET=1`` (the
Triton decode kernel is what a captured graph runs; Triton decides at import whether it is
interpreted): ``python -m tests.unit.cuda_graph_cases`` prints one JSON object that
`tests/unit/test_cuda_graphs.py` checks.

A tiny GQA Llama decodes three sequences (a bucket of 4: one padding row) four steps through the
graphs' static buffers over one pool, and eagerly over an identical pool."""

from __future__ import annotations

import json
import os


from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVPool
from tests.unit.test_engine_runner import TINY, _model


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    model, block = _model(3), 16
    eager_pool, graph_pool = (KVPool(TINY, CacheConfig(block_size=block, num_blocks=24)) for _ in range(2))
    graphs = DecodeGraphs(model, graph_pool, max_batch=4, max_context=96, capture=False)
    assert eager_pool.allocator.allocate(1) == [graphs.pad_block]   # the same block ids in both pools
    prompts = [list(range(1, 30)), list(range(5, 12)), list(range(2, 50))]
    tables = []
    for p in prompts:
        need = -(-(len(p) + 4) // block)
        t = eager_pool.allocator.allocate(need)
        assert graph_pool.allocator.allocate(need) == t
        tables.append(t)
        for pool in (eager_pool, graph_pool):
            model.forward(ForwardBatch.build([SeqChunk(p, 0, t)], block), pool)
    pad_before = graph_pool.kv[:, :, :, graphs.pad_block].clone()
    worst, steps, tokens = 0.0, [], [[p[-1]] for p in prompts]
    for s in range(4):
        step = ForwardBatch.build([SeqChunk([tok[-1]], len(p) + s, t) for p, t, tok in zip(prompts, tables, tokens)],
                                  block)
        want = model.forward(step, eager_pool)
        got = graphs.run(step)
        worst = max(worst, (got - want).abs().max().item())
        steps.append([graphs.bucket(step), list(got.shape)])
        for tok, row in zip(tokens, want):
            tok.append(int(row.argmax()))
    others = [b for b in range(24) if b != graphs.pad_block]
    five = ForwardBatch.build([SeqChunk([1], 3, [b]) for b in others[:5]], block)
    print(json.dumps({
        "worst_logit_diff": worst, "steps": steps,
        "pool_diff": (graph_pool.kv[:, :, :, others] - eager_pool.kv[:, :, :, others]).abs().max().item(),
        "pad_block_written": bool((graph_pool.kv[:, :, :, graphs.pad_block] != pad_before).any()),
        "free_blocks": [eager_pool.allocator.num_free, graph_pool.allocator.num_free],
        "five_rows_run_eagerly": graphs.run(five) is None and graphs.bucket(five) is None,
        "buckets": sorted(graphs.graphs),
    }))


if __name__ == "__main__":
    main()
