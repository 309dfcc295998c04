"""Write planning: block ids -> coalesced byte ranges, one shared deterministic function.

The writer (prefill) and the reader (decode) must agree on how many writes a transfer is, because
the reader knows the KV has arrived when it has counted that many immediates. Both call
:func:`plan_writes` / :func:`count_writes` with the same inputs and get the same answer.

Order of the plan: layer ascending, then K before V, then KV head, then runs in the order of the
block id lists. A *run* is a maximal stretch ``i..j`` of the id lists where both ``src_block_ids``
and ``dst_block_ids`` increase by exactly 1 per step; each run becomes one byte range per
(layer, K|V, head) (the pool is head-major: `kvtransfer.layout`), split into pieces of at most
``max_write_bytes`` bytes.

Layer-by-layer posting: pass ``layers=range(l, l + 1)`` to plan only layer ``l``; the
concatenation of per-layer plans equals the all-layers plan, so counts add up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtransfer.errors import PlanError
from kvtransfer.layout import KV, KVLayout


@dataclass(frozen=True, slots=True)
class PlannedWrite:
    """One contiguous copy: ``length`` bytes from ``src_offset`` (writer's pool) to ``dst_offset``
    (reader's pool). Offsets are bytes from the start of each pool."""

    layer: int
    kv: KV
    src_offset: int
    dst_offset: int
    length: int


def block_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs consecutive on both sides, as ``(src_start, dst_start, num_blocks)``."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _validate(src: KVLayout, dst: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int],
              max_write_bytes: int, layers: Sequence[int]) -> None:
    if not src.compatible_with(dst):
        raise PlanError(f"incompatible layouts: {src} vs {dst}")
    check_transfer(src, dst, src_ids, dst_ids, max_write_bytes, layers)


def check_transfer(src: KVLayout, dst: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int],
                   max_write_bytes: int, layers: Sequence[int]) -> None:
    """Raise ``PlanError`` unless the block id lists pair up (equal lengths, inside each pool,
    no destination twice), ``max_write_bytes`` > 0 and ``layers`` are the pools' (the layouts
    themselves are the caller's to check: `plan_writes` wants them equal but for ``num_blocks``,
    `kvtransfer.tp` lets ``num_kv_heads`` differ too)."""
    if len(src_ids) != len(dst_ids):
        raise PlanError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if max_write_bytes <= 0:
        raise PlanError(f"max_write_bytes must be positive, got {max_write_bytes}")
    for name, ids, layout in (("source", src_ids, src), ("destination", dst_ids, dst)):
        bad = [b for b in ids if not 0 <= b < layout.num_blocks]
        if bad:
            raise PlanError(f"{name} block ids {bad[:4]} outside [0, {layout.num_blocks})")
    if len(set(dst_ids)) != len(dst_ids):
        raise PlanError("destination block ids repeat")
    bad_layers = [l for l in layers if not 0 <= l < src.num_layers]
    if bad_layers:
        raise PlanError(f"layers {bad_layers[:4]} outside [0, {src.num_layers})")


def plan_writes(src_layout: KVLayout, dst_layout: KVLayout, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int], max_write_bytes: int,
                layers: Iterable[int] | None = None) -> list[PlannedWrite]:
    """The deterministic list of writes moving ``src_block_ids`` into ``dst_block_ids``.

    Args:
        src_layout, dst_layout: the two pools; must be :meth:`KVLayout.compatible_with`.
        src_block_ids, dst_block_ids: equal-length block id lists, position i moves to position i.
        max_write_bytes: no write is longer than this (bytes, > 0).
        layers: the layers to plan, in the order given; default all layers.

    Returns: writes ordered by layer, then K|V, then head, then run.
    Raises: ``PlanError`` on any invalid input (nothing is planned partially).
    """
    layer_list = list(range(src_layout.num_layers) if layers is None else layers)
    _validate(src_layout, dst_layout, src_block_ids, dst_block_ids, max_write_bytes, layer_list)
    return plan_head_writes(src_layout, dst_layout, 0, 0, src_layout.num_kv_heads,
                            block_runs(src_block_ids, dst_block_ids), max_write_bytes, layer_list)


def plan_head_writes(src_layout: KVLayout, dst_layout: KVLayout, src_head: int, dst_head: int,
                     num_heads: int, runs: list[tuple[int, int, int]], max_write_bytes: int,
                     layers: list[int]) -> list[PlannedWrite]:
    """The writes moving heads ``src_head ..`` of the writer's pool into heads ``dst_head ..`` of
    the reader's, ``num_heads`` of them, for each of ``runs`` (`block_runs`) and ``layers``
    (checked by the caller): one range per (layer, K|V, head, run), split at ``max_write_bytes``."""
    hb = src_layout.head_block_bytes
    writes: list[PlannedWrite] = []
    for layer in layers:
        for kv in (KV.K, KV.V):
            for h in range(num_heads):
                for src_block, dst_block, n in runs:
                    src_off = src_layout.offset(layer, kv, src_block, src_head + h)
                    dst_off = dst_layout.offset(layer, kv, dst_block, dst_head + h)
                    total = n * hb
                    for start in range(0, total, max_write_bytes):
                        length = min(max_write_bytes, total - start)
                        writes.append(PlannedWrite(layer, kv, src_off + start, dst_off + start, length))
    return writes


def count_writes(src_layout: KVLayout, dst_layout: KVLayout, src_block_ids: Sequence[int],
                 dst_block_ids: Sequence[int], max_write_bytes: int,
                 layers: Iterable[int] | None = None) -> int:
    """``len(plan_writes(...))`` without building the list; same arguments, same errors."""
    layer_list = list(range(src_layout.num_layers) if layers is None else layers)
    _validate(src_layout, dst_layout, src_block_ids, dst_block_ids, max_write_bytes, layer_list)
    hb = src_layout.head_block_bytes
    per_head = sum(-(-(n * hb) // max_write_bytes) for _, _, n in block_runs(src_block_ids, dst_block_ids))
    return per_head * src_layout.num_kv_heads * 2 * len(layer_list)
