from __future__ import annotations

import random

import numpy as np
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


def test_a_long_plans_ops_carry_arrays_and_every_array_path_matches_the_one_op_at_a_time_path():
    """`to_write_ops` gives a `WriteOps` from `VECTOR_MIN_WRITES` writes on (an immutable sequence
    of the ops); its descriptors, copy plan and range checks (array operations) equal those of the
    same ops as a plain list (one Python step per write), errors and their messages included."""
    from kvtransfer import VECTOR_MIN_WRITES, MemoryRegion, RemoteAccessError, WriteOps, to_write_ops
    from kvtransfer.cuda_ipc import copy_plan
    from kvtransfer.frame import pack_descs
    from kvtransfer.software import check_remote_ranges

    rng = random.Random(3)
    src_ids = list(range(40))
    dst_ids = rng.sample(range(300), 40)   # scattered: runs of one and more blocks
    local = MemoryRegion(0, SRC.total_bytes, 0x11)
    plan = plan_writes(SRC, DST, src_ids, dst_ids, 1 << 20)
    assert len(plan) >= VECTOR_MIN_WRITES
    ops = to_write_ops(plan, local, 0x22, 0xABC)
    short = to_write_ops(plan[:VECTOR_MIN_WRITES - 1], local, 0x22, 0xABC)
    assert isinstance(ops, WriteOps) and type(short) is list and ops[:len(short)] == short
    assert len(ops) == len(plan) and ops[3] == list(ops)[3] and ops == list(ops)
    with pytest.raises(TypeError):
        ops[0] = ops[1]   # immutable: a changed batch is a list
    shuffled = list(ops)
    random.Random(1).shuffle(shuffled)   # a list is packed op by op, in its order
    assert pack_descs(shuffled) != pack_descs(ops)
    as_list = list(ops)
    assert pack_descs(ops) == pack_descs(as_list)
    def listed(plan: dict) -> dict:
        assert all(r.dtype == np.int64 and r.ndim == 2 and r.shape[1] == 3 for r in plan.values())
        return {pair: r.tolist() for pair, r in plan.items()}

    assert listed(copy_plan(ops)) == listed(copy_plan(as_list)) and len(copy_plan(ops)[(0x11, 0x22)]) == len(ops)
    whole = to_write_ops(plan_writes(SRC, SRC, list(range(100)), list(range(100)), 1 << 14), local, 0x22, 1)
    assert len(whole) >= VECTOR_MIN_WRITES and listed(copy_plan(whole)) == listed(copy_plan(list(whole))) == {
        (0x11, 0x22): [[0, 0, SRC.total_bytes]]}   # every write contiguous with the last on both sides
    end = max(w.dst_offset + w.length for w in plan)
    assert check_remote_ranges(ops, {0x22: end}) is None   # the last write ends at the region's end
    for lengths in ({0x22: end - 1}, {0x23: end}):   # one write past the end; no such key
        errors = [check_remote_ranges(x, lengths) for x in (ops, as_list)]
        assert isinstance(errors[0], RemoteAccessError) and str(errors[0]) == str(errors[1])
    no_imm = to_write_ops(plan, local, 0x22, None)
    assert pack_descs(no_imm) == pack_descs(list(no_imm))


def test_the_local_range_check_of_a_long_batch_refuses_as_the_short_one_does():
    from kvtransfer import EngineConfig, RemoteAccessError, WriteOps, create_engine, to_write_ops

    engine = create_engine("tcp", EngineConfig(secret=b"k" * 32))
    try:
        plan = plan_writes(SRC, DST, list(range(100)), list(range(100)), 1 << 20)
        whole = to_write_ops(plan, engine.register_memory(torch.zeros(SRC.total_bytes, dtype=torch.uint8)), 0x22, 1)
        assert engine._check_local(whole) == engine._check_local(list(whole)) == SRC.total_bytes
        half = engine.register_memory(torch.zeros(SRC.total_bytes // 2, dtype=torch.uint8))   # the layout's first half
        ops = to_write_ops(plan, half, 0x22, 1)
        assert isinstance(ops, WriteOps)
        errors = []
        for batch in (ops, list(ops)):
            with pytest.raises(RemoteAccessError, match="outside region") as info:
                engine._check_local(batch)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
    finally:
        engine.close()


def test_a_long_batch_is_striped_into_consecutive_runs_of_about_equal_bytes_that_keep_their_arrays():
    """`split_by_bytes` of a `WriteOps`: parts are `WriteOps` (arrays, no op built), consecutive
    runs of the batch in order, each within one write's length of an equal share of the bytes; a
    list is still dealt op by op to the lightest part."""
    from kvtransfer import MemoryRegion, WriteOps, to_write_ops
    from kvtransfer.software import split_by_bytes

    rng = random.Random(5)
    plan = plan_writes(SRC, DST, list(range(0, 80, 2)), rng.sample(range(300), 40), 5000)   # ragged lengths
    ops = to_write_ops(plan, MemoryRegion(0, SRC.total_bytes, 0x11), 0x22, 7)
    total, longest = sum(w.length for w in plan), max(w.length for w in plan)
    for parts in (1, 2, 3, 8):
        split = split_by_bytes(ops, parts)
        assert len(split) == parts and all(isinstance(p, WriteOps) and p._ops is None for p in split)
        assert [op for p in split for op in p] == list(ops)
        for p in split:
            assert abs(int(p.arrays[2].sum()) - total / parts) <= longest
    assert split_by_bytes(ops.rows(0, 2), 8) == [ops.rows(0, 1), ops.rows(1, 2)]   # never an empty part
    dealt = split_by_bytes(list(ops)[:4], 2)
    assert [type(p) for p in dealt] == [list, list] and sorted(map(len, dealt)) == [2, 2]
