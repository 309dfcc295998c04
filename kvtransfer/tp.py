"""KV between tensor-parallel groups of different sizes: which writer rank sends which KV heads to
which reader rank, and the writes that takes.

A group of TP size N holds a model's ``num_kv_heads`` KV heads split over its ranks, or, when N
exceeds them, each head replicated on N / num_kv_heads consecutive ranks (`rank_heads`: the same
split as the engine's, `engine.tp.kv_heads_of`). A prefill group of TP ``a`` and a decode group
of TP ``b`` exchange a request's KV as *routes*: for every decode rank, each KV head it holds comes
from one prefill rank holding that head (among replicas, the one at ``reader rank % replicas``, so
replicated writers share the load), consecutive heads from one writer forming one route.

The pool is head-major (``[L, 2, H, N, block_size, D]``, `kvtransfer.layout`), so one head's run of
consecutive blocks is one contiguous byte range on both sides: a route moves ``layers x 2 x
route heads x runs`` writes (`plan_route_writes`, or as arrays `plan_route_arrays`; counted
without planning by `count_route_writes`), and a request ``layers x 2 x KV heads x runs``
whatever the two TP sizes (each reader head written once). Both sides compute the same routes and
writes, so each decode rank knows how many immediates to count: the sum of its routes' writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer.errors import PlanError
from kvtransfer.layout import KVLayout
from kvtransfer.plan import (PlannedWrite, block_runs, check_transfer, count_head_writes, plan_head_arrays,
                             plan_head_writes)


def rank_heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """``(first, count)``: the model's KV heads that rank ``rank`` of a TP-``size`` group holds.

    Raises PlanError unless ``size`` divides ``num_kv_heads`` or ``num_kv_heads`` divides ``size``
    and ``0 <= rank < size``."""
    if size < 1 or not 0 <= rank < size:
        raise PlanError(f"rank {rank} outside a tensor-parallel group of {size}")
    if num_kv_heads % size == 0:
        return rank * (num_kv_heads // size), num_kv_heads // size
    if size % num_kv_heads == 0:
        return rank // (size // num_kv_heads), 1
    raise PlanError(f"{num_kv_heads} KV heads cannot be split over {size} ranks")


@dataclass(frozen=True, slots=True)
class HeadRoute:
    """Consecutive KV heads one writer rank sends to one reader rank.

    Fields:
        src_rank, dst_rank: the prefill (writer) and decode (reader) TP ranks.
        src_head, dst_head: the first head's index in the writer's and in the reader's pool.
        num_heads: how many consecutive heads.
    """

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def head_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every route from a TP-``src_tp`` writer group to a TP-``dst_tp`` reader group, ordered by
    reader rank then head (module doc). Every head of every reader rank is covered exactly once.
    Raises PlanError as `rank_heads` does."""
    routes: list[HeadRoute] = []
    for dst in range(dst_tp):
        first, count = rank_heads(num_kv_heads, dst, dst_tp)
        for head in range(first, first + count):
            holders = [r for r in range(src_tp) if _holds(num_kv_heads, r, src_tp, head)]
            src = holders[dst % len(holders)]
            src_first = rank_heads(num_kv_heads, src, src_tp)[0]
            last = routes[-1] if routes else None
            if (last is not None and last.dst_rank == dst and last.src_rank == src
                    and last.src_head + last.num_heads == head - src_first
                    and last.dst_head + last.num_heads == head - first):
                routes[-1] = HeadRoute(src, dst, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                routes.append(HeadRoute(src, dst, head - src_first, head - first, 1))
    return routes


def _holds(num_kv_heads: int, rank: int, size: int, head: int) -> bool:
    first, count = rank_heads(num_kv_heads, rank, size)
    return first <= head < first + count


def plan_route_writes(src_layout: KVLayout, dst_layout: KVLayout, route: HeadRoute,
                      src_block_ids: Sequence[int], dst_block_ids: Sequence[int], max_write_bytes: int,
                      layers: Iterable[int] | None = None) -> list[PlannedWrite]:
    """The writes of one route: for each layer, K then V, each of the route's heads, one byte range
    per run of blocks consecutive on both sides (`kvtransfer.plan.block_runs`), split at
    ``max_write_bytes``; a route of every head of both pools is exactly `kvtransfer.plan.plan_writes`.

    Args:
        src_layout, dst_layout: the writer rank's and the reader rank's pools (their
            ``num_kv_heads`` are each rank's own; every other field but ``num_blocks`` must match).
        route: from `head_routes`.
    Raises:
        PlanError: layouts that differ in more than heads and blocks, a route outside either
            pool's heads, block ids of unequal counts, outside a pool or repeated on the reader's
            side, bad layers or ``max_write_bytes``.
    """
    runs, layer_list = _check_route(src_layout, dst_layout, route, src_block_ids, dst_block_ids, max_write_bytes, layers)
    return plan_head_writes(src_layout, dst_layout, route.src_head, route.dst_head, route.num_heads, runs,
                            max_write_bytes, layer_list)


def plan_route_arrays(src_layout: KVLayout, dst_layout: KVLayout, route: HeadRoute,
                      src_block_ids: Sequence[int], dst_block_ids: Sequence[int], max_write_bytes: int,
                      layers: Iterable[int] | None = None) -> np.ndarray:
    """`plan_route_writes` as an int64 array of shape ``(writes, 3)`` of ``(src offset, dst offset,
    length)`` in bytes, same order (`kvtransfer.plan.plan_head_arrays`): no Python step per write.
    Same arguments, same errors."""
    runs, layer_list = _check_route(src_layout, dst_layout, route, src_block_ids, dst_block_ids, max_write_bytes, layers)
    return plan_head_arrays(src_layout, dst_layout, route.src_head, route.dst_head, route.num_heads, runs,
                            max_write_bytes, layer_list)


def count_route_writes(src_layout: KVLayout, dst_layout: KVLayout, route: HeadRoute,
                       src_block_ids: Sequence[int], dst_block_ids: Sequence[int], max_write_bytes: int,
                       layers: Iterable[int] | None = None) -> int:
    """``len(plan_route_writes(...))`` without planning; same arguments, same errors."""
    runs, layer_list = _check_route(src_layout, dst_layout, route, src_block_ids, dst_block_ids, max_write_bytes, layers)
    return count_head_writes(src_layout, runs, route.num_heads, max_write_bytes, len(layer_list))


def _check_route(src_layout: KVLayout, dst_layout: KVLayout, route: HeadRoute, src_block_ids: Sequence[int],
                 dst_block_ids: Sequence[int], max_write_bytes: int,
                 layers: Iterable[int] | None) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The runs (`block_runs`) and layers of a route's writes, after the checks `plan_route_writes`
    names."""
    if (src_layout.num_layers, src_layout.block_size, src_layout.head_dim, src_layout.itemsize) != (
            dst_layout.num_layers, dst_layout.block_size, dst_layout.head_dim, dst_layout.itemsize):
        raise PlanError(f"incompatible layouts: {src_layout} vs {dst_layout}")
    for side, head, layout in (("source", route.src_head, src_layout), ("destination", route.dst_head, dst_layout)):
        if route.num_heads < 1 or head < 0 or head + route.num_heads > layout.num_kv_heads:
            raise PlanError(f"{side} heads [{head}, {head + route.num_heads}) outside the pool's "
                            f"{layout.num_kv_heads} KV heads")
    layer_list = list(range(src_layout.num_layers) if layers is None else layers)
    check_transfer(src_layout, dst_layout, src_block_ids, dst_block_ids, max_write_bytes, layer_list)
    return block_runs(src_block_ids, dst_block_ids), layer_list
