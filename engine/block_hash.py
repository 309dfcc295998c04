"""Chained hashes of full KV blocks: the name of a cached prefix, the same in every process.

Torch-free, so the router (which indexes the workers' caches for KV-aware routing) computes the
same hashes as the workers' allocators (`engine.kv_cache.BlockAllocator`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, start: int = 0, parent: bytes = b"",
                 salt: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` from block ``start`` on: block i's hash
    covers its tokens, ``salt`` (what else shapes its K/V) and the hash of block i - 1
    (``parent`` for block ``start``), so equal hashes mean equal prefixes. BLAKE2b, 16 bytes:
    stable across processes (for routers comparing workers' caches). What else shapes a block's
    K/V (model, dtype, block size, layout) is the same for every worker of a cluster (the router
    admits only one compatibility hash, `engine.config.compatibility_hash`), so ``salt`` is
    empty there.

    Raises:
        struct.error: a token id outside [0, 2**32).
    """
    out = []
    prev = parent
    fmt = struct.Struct(f"<{block_size}I")   # each token id as 4 bytes, little-endian
    for i in range(start, len(token_ids) // block_size):
        h = hashlib.blake2b(prev, digest_size=16, key=salt[:64])
        h.update(fmt.pack(*token_ids[i * block_size:(i + 1) * block_size]))
        prev = h.digest()
        out.append(prev)
    return out
