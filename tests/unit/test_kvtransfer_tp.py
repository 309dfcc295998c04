"""`kvtransfer.tp`: routes between TP groups of any sizes cover every reader head once from a
writer holding it, and executing the planned writes byte for byte puts every head where the reader
expects it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.tp import kv_heads_of
from kvtransfer.errors import PlanError
from kvtransfer.layout import KVLayout
from kvtransfer.plan import plan_writes
from kvtransfer.tp import HeadRoute, count_route_writes, head_routes, plan_route_arrays, plan_route_writes, rank_heads

SIZES = [(4, (1, 2, 4, 8)), (3, (1, 3, 6)), (8, (1, 2, 4, 8, 16)), (1, (1, 2))]
PAIRS = [(kv, a, b) for kv, sizes in SIZES for a in sizes for b in sizes]


@pytest.mark.parametrize("kv,sizes", SIZES)
def test_rank_heads_is_the_engines_split(kv, sizes):
    config = ModelConfig(name="t", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=kv * 16, num_kv_heads=kv, head_dim=4, rope_theta=1e4, rms_norm_eps=1e-5,
                         max_position=8, tie_word_embeddings=True)
    for size in sizes:
        assert [rank_heads(kv, r, size) for r in range(size)] == [kv_heads_of(config, r, size) for r in range(size)]


@pytest.mark.parametrize("kv,a,b", PAIRS)
def test_routes_cover_every_reader_head_once_from_a_writer_that_holds_it(kv, a, b):
    seen = {}
    for r in head_routes(kv, a, b):
        src_first, src_n = rank_heads(kv, r.src_rank, a)
        dst_first, dst_n = rank_heads(kv, r.dst_rank, b)
        assert r.src_head + r.num_heads <= src_n and r.dst_head + r.num_heads <= dst_n
        for i in range(r.num_heads):
            assert src_first + r.src_head + i == dst_first + r.dst_head + i   # the same model head
            key = (r.dst_rank, r.dst_head + i)
            assert key not in seen
            seen[key] = r.src_rank
    assert sorted(seen) == [(d, h) for d in range(b) for h in range(rank_heads(kv, d, b)[1])]


def test_replicated_writers_share_the_readers():
    # 2 KV heads, prefill TP 4 (each head on 2 ranks) -> decode TP 2: each decode rank gets its head
    # from a different replica... and decode TP 4 reads from all four writers
    assert {r.src_rank for r in head_routes(2, 4, 4)} == {0, 1, 2, 3}
    assert head_routes(4, 1, 1) == [HeadRoute(0, 0, 0, 0, 4)]
    assert head_routes(4, 1, 2) == [HeadRoute(0, 0, 0, 0, 2), HeadRoute(0, 1, 2, 0, 2)]
    assert head_routes(4, 4, 2) == [HeadRoute(0, 0, 0, 0, 1), HeadRoute(1, 0, 0, 1, 1),
                                    HeadRoute(2, 1, 0, 0, 1), HeadRoute(3, 1, 0, 1, 1)]


def _pools(full: torch.Tensor, size: int, blocks: int) -> list[torch.Tensor]:
    """Each rank's pool ``[L, 2, its heads, blocks, BS, D]`` cut from ``full``."""
    kv = full.shape[2]
    out = []
    for r in range(size):
        first, n = rank_heads(kv, r, size)
        out.append(full[:, :, first:first + n, :blocks].clone())
    return out


@pytest.mark.parametrize("kv,a,b", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (4, 1, 1), (2, 4, 1), (2, 1, 4),
                                    (3, 3, 1), (3, 1, 3), (4, 8, 2)])
def test_executed_writes_put_every_head_where_the_reader_expects_it(kv, a, b):
    layers, bs, dim = 3, 4, 8
    gen = torch.Generator().manual_seed(kv * 100 + a * 10 + b)
    full = torch.randn(layers, 2, kv, 12, bs, dim, generator=gen)
    writers = _pools(full, a, 12)
    readers = [torch.zeros_like(p[:, :, :, :9]) for p in _pools(full, b, 12)]
    src_ids, dst_ids = [5, 6, 7, 2, 11], [0, 1, 2, 8, 4]   # a run of 3, then scattered
    counts = [0] * b
    for route in head_routes(kv, a, b):
        src, dst = writers[route.src_rank], readers[route.dst_rank]
        sl, dl = KVLayout.from_tensor(src), KVLayout.from_tensor(dst)
        sb, db = src.numpy().view(np.uint8).reshape(-1), dst.numpy().view(np.uint8).reshape(-1)
        plan = plan_route_arrays(sl, dl, route, src_ids, dst_ids, max_write_bytes=96)   # what a worker posts
        for src_off, dst_off, n in plan.tolist():
            db[dst_off:dst_off + n] = sb[src_off:src_off + n]
        counts[route.dst_rank] += len(plan)
    for d in range(b):
        first, n = rank_heads(kv, d, b)
        want = torch.zeros_like(readers[d])
        want[:, :, :, dst_ids] = full[:, :, first:first + n, src_ids]
        assert torch.equal(readers[d], want), d
        assert counts[d] > 0


def test_a_request_takes_as_many_writes_whichever_heads_each_side_holds():
    whole = KVLayout(2, 16, 16, 4, 64, 2)
    half = dataclasses.replace(whole, num_kv_heads=2)
    ids = list(range(8))   # one run
    assert len(plan_route_writes(whole, whole, HeadRoute(0, 0, 0, 0, 4), ids, ids, 1 << 20)) == 2 * 2 * 4
    assert len(plan_route_writes(whole, half, HeadRoute(0, 0, 2, 0, 2), ids, ids, 1 << 20)) == 2 * 2 * 2
    assert (plan_route_writes(whole, whole, HeadRoute(0, 0, 0, 0, 4), ids, ids, 1 << 20)
            == plan_writes(whole, whole, ids, ids, 1 << 20))
    with pytest.raises(PlanError, match=r"source heads \[3, 5\) outside the pool's 4 KV heads"):
        plan_route_writes(whole, half, HeadRoute(0, 0, 3, 0, 2), ids, ids, 1 << 20)
    with pytest.raises(PlanError, match="incompatible layouts"):
        plan_route_writes(whole, dataclasses.replace(half, head_dim=32), HeadRoute(0, 0, 0, 0, 2), ids, ids, 1 << 20)
    with pytest.raises(PlanError, match="cannot be split over 3 ranks"):
        head_routes(4, 3, 1)


def _reference_writes(src: KVLayout, dst: KVLayout, route: HeadRoute, src_ids: list[int], dst_ids: list[int],
                      max_write: int, layers: list[int]) -> list[tuple[int, int, int]]:
    """The plan written out one write at a time from `KVLayout.offset` (layer, K|V, head, run, piece)."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    out = []
    for layer in layers:
        for kv in (0, 1):
            for h in range(route.num_heads):
                for s, d, n in runs:
                    total = n * src.head_block_bytes
                    for start in range(0, total, max_write):
                        out.append((src.offset(layer, kv, s, route.src_head + h) + start,
                                    dst.offset(layer, kv, d, route.dst_head + h) + start, min(max_write, total - start)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_arrays_a_worker_posts_are_the_planned_writes_and_are_counted_without_planning(seed):
    """`plan_route_arrays` (what `worker.tp_rank.post_layers` posts) row for row equals the writes
    computed one at a time from `KVLayout.offset`, for random routes, block ids, layers and splits;
    `plan_route_writes` holds the same writes; `count_route_writes` is their number; and
    `to_write_ops` makes the same ops from the arrays as from the objects, short plans and long."""
    from kvtransfer import MemoryRegion, WriteOps, to_write_ops

    rng = np.random.default_rng(seed)
    kv = int(rng.choice([2, 3, 4, 8]))
    src = KVLayout(4, int(rng.integers(20, 60)), 4, kv, 8, 2)
    dst = dataclasses.replace(src, num_blocks=int(rng.integers(20, 60)))
    n = int(rng.integers(1, 18))
    src_ids = rng.choice(src.num_blocks, n, replace=False).tolist()
    dst_ids = rng.choice(dst.num_blocks, n, replace=False).tolist()
    if seed % 2:   # runs of several blocks too
        src_ids, dst_ids = sorted(src_ids), sorted(dst_ids)
    heads = int(rng.integers(1, kv + 1))
    route = HeadRoute(0, 0, int(rng.integers(0, kv - heads + 1)), int(rng.integers(0, kv - heads + 1)), heads)
    layers = rng.permutation(4)[:int(rng.integers(1, 5))].tolist()
    max_write = int(rng.choice([24, 64, 100, src.head_block_bytes, 1 << 20]))
    want = _reference_writes(src, dst, route, src_ids, dst_ids, max_write, layers)
    rows = plan_route_arrays(src, dst, route, src_ids, dst_ids, max_write, layers)
    assert rows.dtype == np.int64 and rows.shape == (len(want), 3) and [tuple(r) for r in rows.tolist()] == want
    objects = plan_route_writes(src, dst, route, src_ids, dst_ids, max_write, layers)
    assert [(w.src_offset, w.dst_offset, w.length) for w in objects] == want
    assert [(w.layer, int(w.kv)) for w in objects][:1] == [(layers[0], 0)] and objects[-1].layer == layers[-1]
    assert count_route_writes(src, dst, route, src_ids, dst_ids, max_write, layers) == len(want)
    region = MemoryRegion(0, src.total_bytes, 5)
    for cut in (3, len(rows)):
        from_rows, from_objects = to_write_ops(rows[:cut], region, 9, 7), to_write_ops(objects[:cut], region, 9, 7)
        assert list(from_rows) == list(from_objects) and type(from_rows) is type(from_objects)
        if isinstance(from_rows, WriteOps):
            assert all(np.array_equal(a, b) for a, b in zip(from_rows.arrays, from_objects.arrays))
    with pytest.raises(PlanError, match="repeat"):
        count_route_writes(src, dst, route, [0, 1], [2, 2], max_write)
