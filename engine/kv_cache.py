"""The paged KV pool and its block allocator.

Layout (ARCHITECTURE.md, "KV pool layout"): ONE contiguous tensor
``[num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]`` so that a single memory
registration covers the pool and a (layer, K|V, KV head, run of consecutive blocks) is one
contiguous byte range: head-major above the blocks, so a request's transfer takes as many writes
whichever KV heads each side holds (tensor-parallel peers of different sizes: `kvtransfer.tp`;
docs/PERFORMANCE.md, "Writes between TP sizes"). A token at position ``p`` of a sequence lives in block ``block_table[p // block_size]``
at offset ``p % block_size``; its flat slot is ``block * block_size + p % block_size``.

Ownership: the allocator hands out `BlockId`s with a reference count of one; `BlockAllocator.free`
drops one reference and returns the block to the free list at zero. The allocator knows nothing
about transfers: callers that let a remote peer write into blocks must keep them allocated until
the writer is known to have stopped.

Prefix caching (vLLM's automatic prefix caching, at block granularity): a full block whose K/V
are final can be `BlockAllocator.register`-ed under the chained hash of the tokens it holds and
of every token before it (`engine.block_hash.block_hashes`). When its last reference goes, a registered block is
not wiped: it waits in an LRU of cached blocks, still counted as free, and `lookup` hands it
(with a new reference) to a later request whose prompt starts with the same tokens. Allocation
takes never-registered blocks first, then evicts the least recently used cached block. A block
is registered only once its owner will never write it again (all its positions computed), and a
block is handed out by `lookup` only while registered, so a shared block is never written.

KV events (for a KV-aware router, as Dynamo's KV publisher): with `BlockAllocator.track_events`,
every hash that becomes cached (registered) or is evicted is recorded, and `take_events` hands
the changes since the last call, or a snapshot of every cached hash.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from typing import Iterable, Sequence

import torch

from engine.config import CacheConfig, ModelConfig
from engine.errors import CapacityError
from engine.ids import BlockId

# Blocks left free after a sequence's new run for it to grow into (`BlockAllocator.try_allocate`):
# 8 blocks of 16 tokens hold 128 generated tokens before a row's blocks stop being consecutive.
GROWTH_GAP_BLOCKS = 8


class BlockAllocator:
    """Reference-counted allocator of KV block ids ``0 .. num_blocks - 1``.

    Thread-safe: every method is atomic (a decode worker reserves blocks for arriving KV from RPC
    threads while its loop grows sequences). Use `try_allocate` rather than `can_allocate` then
    `allocate` where another thread may allocate in between.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_map = bytearray(b"\x01") * num_blocks   # 1: free and holding no cached prefix
        self._num_free = num_blocks
        self._rover = 0   # where the next search for a run starts (next fit)
        self._refs = [0] * num_blocks
        self._lock = threading.Lock()
        self._cached: OrderedDict[int, bytes] = OrderedDict()   # unreferenced registered blocks (LRU)
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # peak_used_blocks: the most blocks referenced at once since start (the pool's high-water
        # mark, for sizing it: cached but unreferenced blocks do not count)
        self.stats = {"prefix_hit_blocks": 0, "prefix_lookup_blocks": 0, "cache_evictions": 0,
                      "peak_used_blocks": 0}
        self._events: dict[bytes, bool] | None = None   # hash -> cached (True) / evicted (False)
        self._max_events = 0
        self._events_overflowed = False

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-registered ones plus cached (evictable) ones."""
        return self._num_free + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still holding a registered prefix."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[BlockId]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
            CapacityError: fewer than ``n`` blocks are free (nothing is taken).
        """
        blocks = self.try_allocate(n)
        if blocks is None:
            raise CapacityError(
                f"KV pool full: {n} blocks requested, {self.num_free} of {self.num_blocks} free")
        return blocks

    def try_allocate(self, n: int, after: BlockId | None = None, gap: int = 0) -> list[BlockId] | None:
        """Take ``n`` free blocks (reference count 1), or None when fewer are free (nothing taken).

        Placement (the blocks' ids are addresses in the pool, so placement decides how the decode
        attention kernel walks memory: a row's blocks at consecutive ids are one stream per KV
        head, read faster than blocks scattered over the pool; docs/PERFORMANCE.md, "Consecutive
        blocks, the step table with the workers' kernels, and what did not pay"):

        1. with ``after`` (a block the caller holds, the last of its block table), the free blocks
           right after it, while they are free;
        2. the rest as one run of consecutive free blocks that has ``gap`` more free blocks after
           it, left free for the sequence to grow into (next fit from where the last run ended);
           then a run without the gap;
        3. otherwise free blocks one by one in address order, and last the least recently used
           cached blocks (evicting their prefixes).

        A gap is not a reservation: step 3 hands its blocks to anyone once no run is free, so
        placement never makes an allocation fail.

        Raises:
            ValueError: ``n`` or ``gap`` negative.
        """
        if n < 0 or gap < 0:
            raise ValueError(f"cannot allocate {n} blocks with a gap of {gap}")
        with self._lock:
            if n > self._num_free + len(self._cached):
                return None
            blocks: list[int] = []
            free_map = self._free_map
            if after is not None:
                b = after + 1
                while len(blocks) < n and b < self.num_blocks and free_map[b]:
                    free_map[b] = 0   # taken before the run search below
                    blocks.append(b)
                    b += 1
                self._num_free -= len(blocks)
            rest = n - len(blocks)
            if rest and rest <= self._num_free:
                start = self._find_run(rest + gap) if gap else -1
                if start < 0:
                    start = self._find_run(rest)
                if start >= 0:
                    free_map[start:start + rest] = b"\x00" * rest
                    self._num_free -= rest
                    blocks.extend(range(start, start + rest))
                    self._rover = start + rest + gap
            pos = 0
            while len(blocks) < n and self._num_free:
                pos = free_map.find(1, pos)
                free_map[pos] = 0
                self._num_free -= 1
                blocks.append(pos)
            while len(blocks) < n:   # evict the least recently used cached block
                b, h = self._cached.popitem(last=False)
                del self._by_hash[h], self._hash_of[b]
                self.stats["cache_evictions"] += 1
                self._event(h, False)
                blocks.append(b)
            for b in blocks:
                self._refs[b] = 1
            self._note_peak()
        return [BlockId(b) for b in blocks]

    def _find_run(self, length: int) -> int:   # with the lock held
        """The first block of ``length`` consecutive free blocks at or after the rover (wrapping
        around), or -1."""
        run = b"\x01" * length
        start = self._free_map.find(run, self._rover)
        if start < 0:
            start = self._free_map.find(run, 0, self._rover + length - 1)
        return start

    def _note_peak(self) -> None:   # with the lock held
        used = self.num_blocks - self._num_free - len(self._cached)
        if used > self.stats["peak_used_blocks"]:
            self.stats["peak_used_blocks"] = used

    def incref(self, blocks: Iterable[BlockId]) -> None:
        """Add a reference to each (already allocated) block."""
        with self._lock:
            for b in blocks:
                if self._refs[b] <= 0:
                    raise ValueError(f"block {b} is not allocated")
                self._refs[b] += 1

    def free(self, blocks: Iterable[BlockId]) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        with self._lock:
            for b in blocks:
                if self._refs[b] <= 0:
                    raise ValueError(f"double free of block {b}")
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    if b in self._hash_of:
                        self._cached[b] = self._hash_of[b]
                    else:
                        self._free_map[b] = 1
                        self._num_free += 1

    def ref_count(self, block: BlockId) -> int:
        return self._refs[block]

    def register(self, block: BlockId, block_hash: bytes) -> None:
        """Record that ``block`` (referenced, its K/V final) holds the prefix ``block_hash``; a
        hash already held by another block is left as it is."""
        with self._lock:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} is not allocated")
            if block_hash not in self._by_hash and block not in self._hash_of:
                self._by_hash[block_hash] = block
                self._hash_of[block] = block_hash
                self._event(block_hash, True)

    def allocate_after_prefix(self, hashes: Sequence[bytes], n: int,
                              gap: int = 0) -> tuple[list[BlockId], int] | None:
        """``n`` blocks for a sequence: the cached blocks of the longest cached prefix of
        ``hashes`` (`lookup`), then fresh ones (`try_allocate`, a run with ``gap`` free blocks
        after it where the pool has one). Returns ``(blocks, hits)``,
        the ``hits`` cached ones first, or None when the pool cannot hold the rest now
        (nothing taken). Raises `ValueError` when the prefix is longer than ``n`` blocks."""
        hit = self.lookup(hashes) if hashes else []
        if len(hit) > n:
            self.free(hit)
            raise ValueError(f"a cached prefix of {len(hit)} blocks does not fit in {n}")
        rest = self.try_allocate(n - len(hit), gap=gap)
        if rest is None:
            self.free(hit)
            return None
        return hit + rest, len(hit)

    def track_events(self, max_events: int = 1 << 16) -> None:
        """Start recording cache events for `take_events`; past ``max_events`` distinct hashes
        between two calls the log overflows and the next call returns a snapshot."""
        with self._lock:
            self._events, self._max_events = {}, max_events

    def _event(self, block_hash: bytes, cached: bool) -> None:   # with the lock held
        if self._events is None:
            return
        self._events[block_hash] = cached   # only the last change of a hash matters
        if len(self._events) > self._max_events:
            self._events.clear()
            self._events_overflowed = True

    def take_events(self, snapshot: bool = False) -> tuple[bool, list[bytes], list[bytes]]:
        """The cache changes since the last call: ``(is_snapshot, stored, removed)``.

        A snapshot (asked for, or the log overflowed) lists every cached hash in ``stored``
        and nothing in ``removed``; otherwise ``stored`` / ``removed`` are the hashes that
        became cached / were evicted since the last call (each hash's last change only).
        Raises `RuntimeError` unless `track_events` was called."""
        with self._lock:
            if self._events is None:
                raise RuntimeError("KV events are not tracked (track_events)")
            if snapshot or self._events_overflowed:
                self._events.clear()
                self._events_overflowed = False
                return True, list(self._by_hash), []
            stored = [h for h, c in self._events.items() if c]
            removed = [h for h, c in self._events.items() if not c]
            self._events.clear()
            return False, stored, removed

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` are cached now; takes no reference and counts
        in no statistic (a scheduler's estimate: the cache may change before `lookup`)."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._by_hash:
                    break
                n += 1
        return n

    def lookup(self, hashes: Sequence[bytes]) -> list[BlockId]:
        """The blocks holding the longest cached prefix of ``hashes`` (chained block hashes, in
        order), each with a reference taken for the caller."""
        out: list[BlockId] = []
        with self._lock:
            self.stats["prefix_lookup_blocks"] += len(hashes)
            for h in hashes:
                b = self._by_hash.get(h)
                if b is None:
                    break
                if self._refs[b] == 0:
                    del self._cached[b]
                self._refs[b] += 1
                out.append(BlockId(b))
            self.stats["prefix_hit_blocks"] += len(out)
            self._note_peak()
        return out


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size `host_buffer` aligns to (x86-64's and most ARM kernels')."""


def host_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled 1-D ``torch.uint8`` tensor of ``nbytes`` bytes in private anonymous memory,
    starting on a `HUGE_PAGE_BYTES` boundary and advised ``MADV_HUGEPAGE`` before any page of it
    is touched, so that the kernel backs it with transparent huge pages where it allows them
    (``/sys/kernel/mm/transparent_hugepage/enabled`` ``always`` or ``madvise``; with ``never``
    it stays on base pages, as ``torch.zeros`` would). A decode step reads each sequence's blocks
    scattered over the pool, and on base pages nearly every block costs a TLB miss (measured:
    docs/PERFORMANCE.md, "The KV pool on huge pages"). The mapping lives as long as a tensor
    viewing it.

    Raises:
        ValueError: ``nbytes`` is not positive.
        OSError: the mapping cannot be made (out of address space).
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # a kernel without transparent huge pages: base pages, as torch.zeros
            pass
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + nbytes]


class KVPool:
    """The KV cache tensor of one worker plus its allocator.

    Attributes:
        kv: ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``, ``cache.dtype``.
        allocator: the `BlockAllocator` over ``num_blocks``.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, buffer: torch.Tensor | None = None,
                 device: str | torch.device = "cpu"):
        """Allocate the pool (on ``device``: "cpu" or "cuda[:n]"), or build it over ``buffer``
        (its device is used).

        Args:
            buffer: optional 1-D ``torch.uint8`` tensor of at least `nbytes` bytes (for example a
                shared-memory or registered region); the pool is a view of it, zero-filled.
        Raises:
            CapacityError: ``buffer`` is too small.
        """
        self.model = model
        self.cache = cache
        self.shape = (model.num_layers, 2, model.num_kv_heads, cache.num_blocks,
                      cache.block_size, model.head_dim)
        if buffer is None and torch.device(device).type == "cpu":
            need = self.nbytes_for(model, cache)
            self.kv = host_buffer(need).view(cache.torch_dtype).view(self.shape)
            self.kv.zero_()   # every page faulted in now, as torch.zeros does, not in a step
        elif buffer is None:
            self.kv = torch.zeros(self.shape, dtype=cache.torch_dtype, device=device)
        else:
            need = self.nbytes_for(model, cache)
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
                raise CapacityError(f"KV buffer must be 1-D uint8 of >= {need} bytes")
            self.kv = buffer[:need].view(cache.torch_dtype).view(self.shape)
            self.kv.zero_()
        self.allocator = BlockAllocator(cache.num_blocks)

    @staticmethod
    def nbytes_for(model: ModelConfig, cache: CacheConfig) -> int:
        """Bytes of a pool: layers * 2 * blocks * block_size * kv_heads * head_dim * itemsize."""
        itemsize = torch.empty((), dtype=cache.torch_dtype).element_size()
        return (model.num_layers * 2 * cache.num_blocks * cache.block_size
                * model.num_kv_heads * model.head_dim * itemsize)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks, num_kv_heads, block_size, head_dim]`` views (of
        the head-major storage: strided, contiguous in ``head_dim`` and in ``block_size, head_dim``)."""
        return self.kv[layer, 0].transpose(0, 1), self.kv[layer, 1].transpose(0, 1)

    def copy_blocks(self, src: Sequence[BlockId], dst: Sequence[BlockId]) -> None:
        """Copy every layer's K and V of blocks ``src`` into blocks ``dst`` (pairwise; forking a
        sequence's partial last block)."""
        self.kv[:, :, :, list(dst)] = self.kv[:, :, :, list(src)]

    def slots(self, block_table: Sequence[BlockId], start: int, end: int) -> list[int]:
        """Flat slot indices of positions ``start .. end - 1`` of a sequence."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]
