"""Byte geometry of a worker's KV pool.

The pool is ONE contiguous buffer shaped
``[num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]`` of ``itemsize``-byte
elements, so one memory registration covers it and a (layer, K|V, KV head, run of consecutive block
ids) is one contiguous byte range: a peer holding other KV heads (another tensor-parallel size,
`kvtransfer.tp`) moves a request in as many writes as one holding the same heads. Prefill and decode
pools share every field but ``num_blocks`` (and, between TP sizes, ``num_kv_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from kvtransfer.errors import PlanError

POOL_LAYOUT = "L,2,H,N,B,D"
"""The pool's dimension order as handshakes name it (the compatibility hash's, `engine.config`)."""


class KV(IntEnum):
    """Index of the K and V halves in the pool's second dimension."""

    K = 0
    V = 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one KV pool, in elements; byte offsets are derived.

    Fields:
        num_layers: transformer layers (SmolLM2-135M: 30).
        num_blocks: blocks in this pool (differs between prefill and decode).
        block_size: tokens per block (default 16).
        num_kv_heads: KV heads (SmolLM2-135M: 3).
        head_dim: elements per head (SmolLM2-135M: 64).
        itemsize: bytes per element (4 for float32, 2 for bfloat16/float16).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    itemsize: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "itemsize"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def from_tensor(cls, pool: torch.Tensor) -> "KVLayout":
        """The layout of a pool tensor shaped ``[L, 2, H, N, block_size, D]``.

        Raises ``PlanError`` unless the tensor is 6-d, contiguous and has 2 in dimension 1.
        """
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise PlanError(f"KV pool must be [L, 2, H, N, block_size, D], got {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise PlanError("KV pool must be contiguous")
        layers, _, heads, blocks, block_size, head_dim = (int(x) for x in pool.shape)
        return cls(layers, blocks, block_size, heads, head_dim, pool.element_size())

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one block of one (layer, K|V, KV head): ``block_size * head_dim * itemsize``; a
        run of consecutive blocks of one head is contiguous."""
        return self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one (layer, K|V), every head: ``num_kv_heads * head_block_bytes``
        (``num_kv_heads`` ranges)."""
        return self.num_kv_heads * self.head_block_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across the pool: every layer, K and V (``num_layers * 2 *
        block_bytes``); what a transfer moves per block."""
        return self.num_layers * 2 * self.block_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_blocks * self.bytes_per_block

    def offset(self, layer: int, kv: int, block: int, head: int = 0) -> int:
        """Byte offset of ``block`` of (``layer``, ``kv``, KV ``head``) from the start of the pool.

        Raises ``PlanError`` if any index is out of range.
        """
        if not 0 <= layer < self.num_layers:
            raise PlanError(f"layer {layer} outside [0, {self.num_layers})")
        if kv not in (KV.K, KV.V):
            raise PlanError(f"kv must be 0 (K) or 1 (V), got {kv}")
        if not 0 <= head < self.num_kv_heads:
            raise PlanError(f"head {head} outside [0, {self.num_kv_heads})")
        if not 0 <= block < self.num_blocks:
            raise PlanError(f"block {block} outside [0, {self.num_blocks})")
        return (((layer * 2 + kv) * self.num_kv_heads + head) * self.num_blocks + block) * self.head_block_bytes

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def compatible_with(self, other: "KVLayout") -> bool:
        """True when every field but ``num_blocks`` matches, i.e. blocks can be copied 1:1."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.itemsize) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.itemsize)
