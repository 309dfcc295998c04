"""A tensor-parallel worker's data plane as one description: an endpoint per TP rank.

Every rank of a TP group is its own data-plane endpoint (its own transfer engine, registered pool
and, with verbs, its own MR and QPs). The group's rank 0 publishes a `GroupEndpoint`: the TP size,
the model's KV heads, the pool layout per rank, and each rank's `EndpointInfo`, in rank order. The
router carries its bytes verbatim, as it carries a single endpoint's (a TP-1 worker's group *is*
its one endpoint on the wire, so TP-1 peers see what they always saw). A writer group connects
each of its ranks to the reader ranks its routes name (`kvtransfer.tp.head_routes`), so the
connections are rank to rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvtransfer.endpoint import EndpointInfo
from kvtransfer.errors import TransferError
from kvtransfer.layout import POOL_LAYOUT, KVLayout
from kvtransfer.tp import rank_heads

GROUP_VERSION = 1
_MAGIC = "pdserve-kv-group"


@dataclass(frozen=True, slots=True)
class GroupEndpoint:
    """A worker's endpoints, one per TP rank (rank order), and what a writer must know to plan
    writes into them.

    Fields:
        ranks: each rank's `EndpointInfo`; its first region is that rank's KV pool.
        num_kv_heads: the model's KV heads (the whole model's, not one rank's); 0 when unknown
            (a TP-1 endpoint on the wire carries none: its pool holds every head).
        layout: the pool's layout string (`kvtransfer.layout.POOL_LAYOUT`), "" when unknown.
    """

    ranks: tuple[EndpointInfo, ...]
    num_kv_heads: int = 0
    layout: str = ""

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def to_bytes(self) -> bytes:
        """A TP-1 group: its endpoint's own bytes; otherwise a versioned JSON document."""
        if len(self.ranks) == 1:
            return self.ranks[0].to_bytes()
        doc = {"magic": _MAGIC, "version": GROUP_VERSION, "num_kv_heads": self.num_kv_heads,
               "layout": self.layout, "ranks": [json.loads(r.to_bytes()) for r in self.ranks]}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "GroupEndpoint":
        """Parse `to_bytes` output or a single endpoint's bytes (a TP-1 group). Raises
        TransferError when malformed or of another version."""
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise TransferError(f"malformed endpoint description: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("magic") != _MAGIC:
            return cls((EndpointInfo.from_bytes(data),))
        if doc.get("version") != GROUP_VERSION:
            raise TransferError(f"endpoint group version {doc.get('version')}, this build speaks {GROUP_VERSION}")
        try:
            ranks = tuple(EndpointInfo.from_bytes(json.dumps(r).encode()) for r in doc["ranks"])
            group = cls(ranks, int(doc["num_kv_heads"]), str(doc["layout"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed endpoint group: {exc}") from exc
        if not ranks:
            raise TransferError("endpoint group with no ranks")
        return group

    def rank_layouts(self, local: KVLayout, num_kv_heads: int, who: str) -> list[tuple[KVLayout, int]]:
        """Each rank's pool as ``(layout, region key)``, checked against this side's.

        Args:
            local: the writer's own pool layout (one rank's); its layers, block size, head size
                and dtype must match every reader rank's.
            num_kv_heads: the writer's model's KV heads.
            who: the reader, for messages (e.g. "decode worker d0").
        Raises:
            TransferError naming both sides: another layout or number of KV heads, a TP size the
                heads cannot be split over, a rank with no region or one that is not a whole
                number of blocks, ranks of different block counts.
        """
        if self.layout and self.layout != POOL_LAYOUT:
            raise TransferError(f"{who} lays its KV pool out as {self.layout}, this worker as {POOL_LAYOUT}")
        if self.num_kv_heads and self.num_kv_heads != num_kv_heads:
            raise TransferError(f"{who}'s model has {self.num_kv_heads} KV heads, this worker's {num_kv_heads}")
        out = []
        for rank, info in enumerate(self.ranks):
            try:
                heads = rank_heads(num_kv_heads, rank, self.tp_size)[1]
            except ValueError as exc:   # PlanError
                raise TransferError(f"{who} at tensor parallel size {self.tp_size} cannot be written by this "
                                    f"worker: {exc}") from exc
            if not info.regions:
                raise TransferError(f"{who} rank {rank} registered no memory")
            region = info.regions[0]
            per_block = local.num_layers * 2 * heads * local.block_size * local.head_dim * local.itemsize
            if region.length % per_block:
                raise TransferError(f"{who} rank {rank}: a pool of {region.length} bytes is not a whole number of "
                                    f"blocks of {heads} KV heads of this worker's layout ({per_block} bytes)")
            out.append((KVLayout(local.num_layers, region.length // per_block, local.block_size, heads,
                                 local.head_dim, local.itemsize), region.key))
        if len({layout.num_blocks for layout, _ in out}) > 1:
            raise TransferError(f"{who}'s ranks hold different numbers of blocks: "
                                f"{[layout.num_blocks for layout, _ in out]}")
        return out
