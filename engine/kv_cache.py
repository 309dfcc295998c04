"""The paged KV pool and its block allocator.

Layout (ARCHITECTURE.md, "KV pool layout"): ONE contiguous tensor
``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` so that a single memory
registration covers the pool and (layer, K|V, run of consecutive blocks) is one contiguous byte
range. A token at position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``; its flat slot is ``block * block_size + p % block_size``.

Ownership: the allocator hands out `BlockId`s with a reference count of one; `BlockAllocator.free`
drops one reference and returns the block to the free list at zero. The allocator knows nothing
about transfers: callers that let a remote peer write into blocks must keep them allocated until
the writer is known to have stopped.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable, Sequence

import torch

from engine.config import CacheConfig, ModelConfig
from engine.errors import CapacityError
from engine.ids import BlockId


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
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[BlockId]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
            CapacityError: fewer than ``n`` blocks are free (nothing is taken).
        """
        blocks = self.try_allocate(n)
        if blocks is None:
            raise CapacityError(
                f"KV pool full: {n} blocks requested, {len(self._free)} of {self.num_blocks} free")
        return blocks

    def try_allocate(self, n: int) -> list[BlockId] | None:
        """Take ``n`` free blocks (reference count 1), or None when fewer are free (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n > len(self._free):
                return None
            blocks = [self._free.popleft() for _ in range(n)]
            for b in blocks:
                self._refs[b] = 1
        return [BlockId(b) for b in blocks]

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
                    self._free.append(b)

    def ref_count(self, block: BlockId) -> int:
        return self._refs[block]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class KVPool:
    """The KV cache tensor of one worker plus its allocator.

    Attributes:
        kv: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, ``cache.dtype``.
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
        self.shape = (model.num_layers, 2, cache.num_blocks, cache.block_size,
                      model.num_kv_heads, model.head_dim)
        if buffer is None:
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
        """K and V of one layer as ``[num_blocks * block_size, num_kv_heads, head_dim]`` views."""
        flat = self.kv[layer].view(2, -1, self.model.num_kv_heads, self.model.head_dim)
        return flat[0], flat[1]

    def slots(self, block_table: Sequence[BlockId], start: int, end: int) -> list[int]:
        """Flat slot indices of positions ``start .. end - 1`` of a sequence."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]
