"""Block allocator, KV pool layout and batch construction: pure logic."""

from __future__ import annotations

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig, ModelConfig
from engine.errors import CapacityError
from engine.kv_cache import BlockAllocator, KVPool, blocks_needed

pytestmark = pytest.mark.unit

TINY = ModelConfig(name="tiny", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position=128, tie_word_embeddings=True)


def test_allocate_free_refcounts():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert len(set(blocks)) == 3 and a.num_free == 1
    a.incref(blocks[:1])
    a.free(blocks)
    assert a.num_free == 3 and a.ref_count(blocks[0]) == 1
    a.free(blocks[:1])
    assert a.num_free == 4


def test_over_allocation_raises_and_takes_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(CapacityError, match="1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1


def test_double_free_is_an_error():
    a = BlockAllocator(2)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_pool_is_one_contiguous_tensor_in_the_documented_layout():
    pool = KVPool(TINY, CacheConfig(block_size=8, num_blocks=5))
    assert pool.kv.shape == (2, 2, 5, 8, 2, 4)
    assert pool.kv.is_contiguous()
    assert pool.kv.numel() * 4 == KVPool.nbytes_for(TINY, pool.cache)
    k, v = pool.layer_view(1)
    k[3 * 8 + 2] = 7.0  # block 3, offset 2 of layer 1's K
    assert torch.all(pool.kv[1, 0, 3, 2] == 7.0)
    assert v.data_ptr() == pool.kv[1, 1].data_ptr()


def test_pool_over_external_buffer():
    nbytes = KVPool.nbytes_for(TINY, CacheConfig(block_size=8, num_blocks=5))
    buf = torch.full((nbytes + 10,), 0xFF, dtype=torch.uint8)
    pool = KVPool(TINY, CacheConfig(block_size=8, num_blocks=5), buffer=buf)
    assert pool.kv.data_ptr() == buf.data_ptr() and int(buf[:nbytes].sum()) == 0
    with pytest.raises(CapacityError):
        KVPool(TINY, CacheConfig(block_size=8, num_blocks=5), buffer=buf[:100])


def test_forward_batch_slots_and_decode_mask():
    batch = ForwardBatch.build([SeqChunk([5], 9, [3, 1]), SeqChunk([6], 2, [4])], block_size=8)
    assert batch.is_decode
    assert batch.slot_mapping.tolist() == [1 * 8 + 1, 4 * 8 + 2]
    assert batch.block_tables.tolist() == [[3, 1], [4, 0]]
    assert batch.attn_mask[0, 0, 0].sum() == 10 and batch.attn_mask[1, 0, 0].sum() == 3


def test_forward_batch_rejects_short_block_table():
    with pytest.raises(ValueError):
        ForwardBatch.build([SeqChunk([1] * 9, 0, [0])], block_size=8)
