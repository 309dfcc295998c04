from __future__ import annotations

import random

import pytest
import torch

from kvtransfer import KV, KVLayout, PlanError, count_writes, plan_writes
from kvtransfer.plan import block_runs

pytestmark = pytest.mark.unit

SMOL = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, itemsize=4)
SRC = KVLayout(num_blocks=100, **SMOL)
DST = KVLayout(num_blocks=300, **SMOL)
BB = SRC.block_bytes
HB = SRC.head_block_bytes


def test_layout_from_tensor_and_offsets():
    pool = torch.zeros(30, 2, 3, 7, 16, 64, dtype=torch.bfloat16)   # [L, 2, H, N, block_size, D]
    layout = KVLayout.from_tensor(pool)
    assert layout == KVLayout(30, 7, 16, 3, 64, 2)
    assert layout.block_bytes == 16 * 3 * 64 * 2
    assert layout.total_bytes == pool.numel() * 2
    # offset matches the tensor's own strides
    for layer, kv, block, head in [(0, 0, 0, 0), (3, 1, 5, 2), (29, 1, 6, 1)]:
        expected = (pool[layer, kv, head, block].data_ptr() - pool.data_ptr())
        assert layout.offset(layer, kv, block, head) == expected
    assert layout.head_block_bytes == 16 * 64 * 2
    with pytest.raises(PlanError):
        KVLayout.from_tensor(torch.zeros(30, 3, 3, 7, 16, 64))
    with pytest.raises(PlanError):
        layout.offset(0, 0, 7)


def test_runs_coalesce_only_when_consecutive_on_both_sides():
    assert block_runs([1, 2, 3, 7], [10, 11, 12, 13]) == [(1, 10, 3), (7, 13, 1)]
    assert block_runs([1, 2, 3], [10, 12, 13]) == [(1, 10, 1), (2, 12, 2)]
    assert block_runs([], []) == []


def test_plan_offsets_order_and_split():
    plan = plan_writes(SRC, DST, [4, 5, 6, 9], [20, 21, 22, 0], max_write_bytes=2 * HB)
    # per (layer, kv, head): run of 3 blocks split into 2 + 1, then the single block: 3 writes
    assert len(plan) == 30 * 2 * 3 * 3
    first = plan[:3]
    assert [(w.layer, w.kv) for w in first] == [(0, KV.K)] * 3
    assert first[0].src_offset == SRC.offset(0, 0, 4) and first[0].dst_offset == DST.offset(0, 0, 20)
    assert first[0].length == 2 * HB and first[1].length == HB
    assert first[1].src_offset == SRC.offset(0, 0, 6) and first[1].dst_offset == DST.offset(0, 0, 22)
    assert first[2].src_offset == SRC.offset(0, 0, 9) and first[2].dst_offset == DST.offset(0, 0, 0)
    assert plan[3].src_offset == SRC.offset(0, 0, 4, head=1)   # then head 1's runs
    assert plan[9].kv == KV.V and plan[-1].layer == 29


def test_plan_moves_exactly_the_blocks():
    rng = random.Random(1)
    src_pool = torch.randn(30, 2, 3, 100, 16, 64)
    dst_pool = torch.zeros(30, 2, 3, 300, 16, 64)
    src_ids = rng.sample(range(100), 40)
    dst_ids = rng.sample(range(300), 40)
    s = src_pool.view(torch.uint8).view(-1)
    d = dst_pool.view(torch.uint8).view(-1)
    for w in plan_writes(SRC, DST, src_ids, dst_ids, max_write_bytes=5000):
        assert w.length <= 5000
        d[w.dst_offset:w.dst_offset + w.length] = s[w.src_offset:w.src_offset + w.length]
    assert torch.equal(dst_pool[:, :, :, dst_ids], src_pool[:, :, :, src_ids])
    untouched = sorted(set(range(300)) - set(dst_ids))
    assert not dst_pool[:, :, :, untouched].any()


@pytest.mark.parametrize("max_write", [1000, BB, 3 * BB, 1 << 30])
def test_layer_by_layer_plans_concatenate_to_the_full_plan(max_write):
    rng = random.Random(max_write)
    src_ids = rng.sample(range(100), 33)
    dst_ids = rng.sample(range(300), 33)
    full = plan_writes(SRC, DST, src_ids, dst_ids, max_write)
    per_layer = [w for l in range(30) for w in plan_writes(SRC, DST, src_ids, dst_ids, max_write, layers=range(l, l + 1))]
    assert per_layer == full
    assert count_writes(SRC, DST, src_ids, dst_ids, max_write) == len(full)
    assert sum(count_writes(SRC, DST, src_ids, dst_ids, max_write, layers=[l]) for l in range(30)) == len(full)
    assert plan_writes(SRC, DST, src_ids, dst_ids, max_write) == full   # deterministic


def test_plan_rejects_bad_input():
    with pytest.raises(PlanError):
        plan_writes(SRC, KVLayout(10, 300, 16, 3, 64, 4), [0], [0], 1 << 20)   # layer mismatch
    with pytest.raises(PlanError):
        plan_writes(SRC, DST, [0, 1], [0], 1 << 20)
    with pytest.raises(PlanError):
        plan_writes(SRC, DST, [100], [0], 1 << 20)
    with pytest.raises(PlanError):
        plan_writes(SRC, DST, [0, 1], [5, 5], 1 << 20)
    with pytest.raises(PlanError):
        plan_writes(SRC, DST, [0], [0], 0)
    with pytest.raises(PlanError):
        count_writes(SRC, DST, [0], [0], 1 << 20, layers=[30])
