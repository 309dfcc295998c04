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

import numpy as np

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
    (checked by the caller): one range per (layer, K|V, head, run), split at ``max_write_bytes``.
    The same writes as `plan_head_arrays`, as objects."""
    rows = plan_head_arrays(src_layout, dst_layout, src_head, dst_head, num_heads, runs, max_write_bytes, layers)
    per_kv = len(rows) // (2 * len(layers)) if len(layers) else 0   # writes per (layer, K|V)
    return [PlannedWrite(layers[i // (2 * per_kv)], KV((i // per_kv) % 2), src, dst, n)
            for i, (src, dst, n) in enumerate(rows.tolist())]


def run_pieces(runs: list[tuple[int, int, int]], head_block_bytes: int,
               max_write_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each run of ``runs`` (`block_runs`) as one head's byte ranges, split at ``max_write_bytes``:
    ``(src start, dst start, length)`` int64 arrays in bytes, relative to the head's first block on
    each side; run order, then piece order."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    total = r[:, 2] * head_block_bytes
    pieces = -(-total // max_write_bytes)
    run = np.repeat(np.arange(len(r)), pieces)
    first = np.cumsum(pieces) - pieces   # each run's first piece
    start = (np.arange(len(run)) - first[run]) * max_write_bytes
    length = np.minimum(max_write_bytes, total[run] - start)
    return r[run, 0] * head_block_bytes + start, r[run, 1] * head_block_bytes + start, length


def plan_head_arrays(src_layout: KVLayout, dst_layout: KVLayout, src_head: int, dst_head: int,
                     num_heads: int, runs: list[tuple[int, int, int]], max_write_bytes: int,
                     layers: list[int]) -> np.ndarray:
    """`plan_head_writes` as an int64 array of shape ``(writes, 3)``: ``(src offset, dst offset,
    length)`` rows in bytes, in the plan's order (layer, K|V, head, run, piece), with no Python
    step per write: what a prefill worker posts each layer (`kvtransfer.to_write_ops` takes it
    as it is). Offsets follow `KVLayout.offset`; the arguments were checked by the caller."""
    src_piece, dst_piece, length = run_pieces(runs, src_layout.head_block_bytes, max_write_bytes)
    layer = np.repeat(np.asarray(layers, dtype=np.int64), 2 * num_heads)
    kv = np.tile(np.repeat(np.arange(2, dtype=np.int64), num_heads), len(layers))
    head = np.tile(np.arange(num_heads, dtype=np.int64), 2 * len(layers))
    hb = src_layout.head_block_bytes

    def base(layout: KVLayout, first_head: int) -> np.ndarray:   # KVLayout.offset of block 0
        return ((layer * 2 + kv) * layout.num_kv_heads + first_head + head) * layout.num_blocks * hb

    rows = np.empty((len(layer), len(length), 3), dtype=np.int64)
    rows[:, :, 0] = base(src_layout, src_head)[:, None] + src_piece
    rows[:, :, 1] = base(dst_layout, dst_head)[:, None] + dst_piece
    rows[:, :, 2] = length
    return rows.reshape(-1, 3)


def count_head_writes(src_layout: KVLayout, runs: list[tuple[int, int, int]], num_heads: int,
                      max_write_bytes: int, num_layers: int) -> int:
    """``len(plan_head_writes(...))`` of those arguments, without planning."""
    hb = src_layout.head_block_bytes
    return sum(-(-(n * hb) // max_write_bytes) for _, _, n in runs) * num_heads * 2 * num_layers


def count_writes(src_layout: KVLayout, dst_layout: KVLayout, src_block_ids: Sequence[int],
                 dst_block_ids: Sequence[int], max_write_bytes: int,
                 layers: Iterable[int] | None = None) -> int:
    """``len(plan_writes(...))`` without building the list; same arguments, same errors."""
    layer_list = list(range(src_layout.num_layers) if layers is None else layers)
    _validate(src_layout, dst_layout, src_block_ids, dst_block_ids, max_write_bytes, layer_list)
    return count_head_writes(src_layout, block_runs(src_block_ids, dst_block_ids), src_layout.num_kv_heads,
                             max_write_bytes, len(layer_list))
