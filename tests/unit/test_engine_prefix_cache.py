"""The block allocator's prefix cache: pure logic (no model)."""

from __future__ import annotations

import pytest

from engine.block_hash import block_hashes
from engine.kv_cache import BlockAllocator

pytestmark = pytest.mark.unit


def test_chained_hashes_identify_prefixes_not_blocks():
    a = block_hashes(list(range(40)), 16)          # 2 full blocks, 8 tokens left out
    b = block_hashes(list(range(32)) + [7] * 9, 16)
    assert len(a) == 2 and a == b                    # same leading blocks
    c = block_hashes([99] + list(range(1, 32)), 16)
    assert c[0] != a[0] and c[1] != a[1]             # block 1's tokens equal, its prefix differs
    assert block_hashes(list(range(32)), 16, start=1, parent=a[0]) == a[1:]
    assert block_hashes(list(range(32)), 16, salt=b"bf16") != a


def test_freed_registered_blocks_stay_cached_until_evicted_lru():
    alloc = BlockAllocator(4)
    hs = block_hashes(list(range(48)), 16)
    blocks = alloc.allocate(3)
    for b, h in zip(blocks, hs):
        alloc.register(b, h)
    alloc.free(blocks)
    assert alloc.num_free == 4 and alloc.num_cached == 3
    hit = alloc.lookup(hs[:2] + [b"missing-hash-xxx"])
    assert hit == blocks[:2] and alloc.num_cached == 1 and alloc.num_free == 2
    assert [alloc.ref_count(b) for b in hit] == [1, 1]
    assert alloc.lookup(hs[:1]) == blocks[:1] and alloc.ref_count(blocks[0]) == 2   # shared
    alloc.free(hit + blocks[:1])
    # allocation takes never-registered blocks first, then evicts the least recently used
    fresh = alloc.allocate(2)
    assert blocks[2] in fresh and alloc.stats["cache_evictions"] == 1
    again = alloc.lookup(hs)                 # the evicted third block ends the hit
    assert again == blocks[:2]
    alloc.free(fresh + again)
    assert alloc.num_free == 4


def test_a_block_is_never_handed_out_twice_by_eviction_while_referenced():
    alloc = BlockAllocator(2)
    [b] = alloc.allocate(1)
    alloc.register(b, b"h" * 16)
    shared = alloc.lookup([b"h" * 16])
    assert shared == [b] and alloc.ref_count(b) == 2
    other = alloc.allocate(1)
    assert other != [b] and alloc.try_allocate(1) is None    # b is referenced: not evictable
    alloc.free([b, b])
    alloc.free(other)
    assert alloc.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        alloc.register(b, b"x" * 16)


def test_kv_events_report_stored_and_evicted_hashes_and_snapshots():
    alloc = BlockAllocator(3)
    with pytest.raises(RuntimeError):
        alloc.take_events()
    alloc.track_events(max_events=8)
    hs = block_hashes(list(range(64)), 16)          # 4 chained hashes
    blocks = alloc.allocate(3)
    for b, h in zip(blocks, hs):
        alloc.register(b, h)
    alloc.register(blocks[0], hs[0])                 # already held: no new event
    assert alloc.take_events() == (False, hs[:3], [])
    assert alloc.take_events() == (False, [], [])
    alloc.free(blocks)                               # cached, still held: no event
    [b] = alloc.allocate(1)                          # evicts the least recently used (hs[0])
    alloc.register(b, hs[3])
    snap, stored, removed = alloc.take_events()
    assert not snap and stored == [hs[3]] and removed == [hs[0]]
    assert alloc.take_events(snapshot=True) == (True, sorted(hs[1:], key=hs.index), [])
    # evicted then cached again between two calls: only the last change counts
    alloc.free([b])
    again = alloc.allocate(3)                        # evicts hs[1], hs[2], hs[3]
    alloc.register(again[0], hs[1])
    snap, stored, removed = alloc.take_events()
    assert stored == [hs[1]] and sorted(removed) == sorted(hs[2:])


def test_kv_event_log_overflow_turns_into_a_snapshot():
    alloc = BlockAllocator(8)
    alloc.track_events(max_events=2)
    hs = block_hashes(list(range(16 * 5)), 16)
    blocks = alloc.allocate(5)
    for b, h in zip(blocks, hs):
        alloc.register(b, h)
    snap, stored, removed = alloc.take_events()
    assert snap and sorted(stored) == sorted(hs) and removed == []
    assert alloc.take_events() == (False, [], [])
