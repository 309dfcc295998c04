"""A CPU KV pool's memory (`engine.kv_cache.host_buffer`): zero-filled, aligned, and on
transparent huge pages where the kernel allows them."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, ModelConfig
from engine.kv_cache import HUGE_PAGE_BYTES, KVPool, host_buffer

pytestmark = pytest.mark.unit

TINY = ModelConfig(name="tiny", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position=128, tie_word_embeddings=True)


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_cpu_pool_lies_on_transparent_huge_pages_where_the_kernel_allows_them():
    """`host_buffer` (a CPU pool's memory): zero-filled, on a huge-page boundary, and, where
    the kernel's THP mode is ``madvise`` or ``always``, backed by huge pages once touched (a pool
    of ``torch.zeros`` under ``madvise`` has none: the advice is what the test checks)."""
    buf = host_buffer(8 * HUGE_PAGE_BYTES)
    assert buf.dtype == torch.uint8 and buf.numel() == 8 * HUGE_PAGE_BYTES
    assert buf.data_ptr() % HUGE_PAGE_BYTES == 0 and int(buf.count_nonzero()) == 0
    with pytest.raises(ValueError):
        host_buffer(0)
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        pytest.skip("no transparent huge pages on this kernel (no /sys/kernel/mm/transparent_hugepage)")
    if mode == "never":
        pytest.skip("transparent huge pages are off on this host (enabled: never)")
    buf.fill_(1)
    assert _anon_huge_kb(buf.data_ptr()) >= HUGE_PAGE_BYTES // 1024, "no huge page behind the pool"
    pool = KVPool(TINY, CacheConfig(block_size=8, num_blocks=4096))
    assert pool.kv.data_ptr() % HUGE_PAGE_BYTES == 0 and _anon_huge_kb(pool.kv.data_ptr()) > 0
    assert int(pool.kv.count_nonzero()) == 0
