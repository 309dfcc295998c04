"""A tensor-parallel worker's endpoint group (`kvtransfer.group`): its bytes, and the checks a
writer makes before planning writes into each rank's pool."""

from __future__ import annotations

import pytest

from kvtransfer import EndpointInfo, KVLayout, MemoryRegion, TransferError, TransportAddress, TransportKind
from kvtransfer.group import GroupEndpoint
from kvtransfer.layout import POOL_LAYOUT

# a writer rank's pool: 2 layers, 64 blocks of 16 tokens, 2 KV heads of 8 float32
LOCAL = KVLayout(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8, itemsize=4)
HEAD_BLOCK = 2 * 2 * 16 * 8 * 4   # one KV head of one block over both layers, K and V


def _rank(i: int, heads: int, blocks: int = 32) -> EndpointInfo:
    return EndpointInfo(f"ep{i}", "host", (MemoryRegion(4096 * i, blocks * heads * HEAD_BLOCK, 100 + i),),
                        (TransportAddress(TransportKind.TCP, "127.0.0.1", 5000 + i),))


def test_a_tp1_group_is_its_endpoint_on_the_wire():
    one = _rank(0, 4)
    assert GroupEndpoint((one,), 4, POOL_LAYOUT).to_bytes() == one.to_bytes()
    assert GroupEndpoint.from_bytes(one.to_bytes()) == GroupEndpoint((one,))


def test_a_group_round_trips_and_gives_each_ranks_pool():
    group = GroupEndpoint(tuple(_rank(i, 1) for i in range(4)), 4, POOL_LAYOUT)
    back = GroupEndpoint.from_bytes(group.to_bytes())
    assert back == group and back.tp_size == 4
    pools = back.rank_layouts(LOCAL, 4, "decode worker d")
    assert [key for _, key in pools] == [100, 101, 102, 103]
    assert {(lay.num_kv_heads, lay.num_blocks) for lay, _ in pools} == {(1, 32)}


def test_replicated_heads_give_each_rank_one_head():
    group = GroupEndpoint(tuple(_rank(i, 1) for i in range(4)), 2, POOL_LAYOUT)   # 2 heads over 4 ranks
    assert [lay.num_kv_heads for lay, _ in group.rank_layouts(LOCAL, 2, "d")] == [1] * 4


@pytest.mark.parametrize("group,heads,match", [
    (GroupEndpoint(tuple(_rank(i, 1) for i in range(3)), 4, POOL_LAYOUT), 4,
     "decode worker d at tensor parallel size 3 cannot be written"),
    (GroupEndpoint((_rank(0, 2), _rank(1, 2)), 8, POOL_LAYOUT), 4, "decode worker d's model has 8 KV heads, this worker's 4"),
    (GroupEndpoint((_rank(0, 2), _rank(1, 2)), 4, "L,2,N,B,H,D"), 4, "lays its KV pool out as L,2,N,B,H,D"),
    (GroupEndpoint((_rank(0, 2), _rank(1, 3, blocks=31)), 4, POOL_LAYOUT), 4, "rank 1: a pool of .* not a whole number of blocks"),
    (GroupEndpoint((_rank(0, 2), _rank(1, 2, blocks=16)), 4, POOL_LAYOUT), 4, r"different numbers of blocks: \[32, 16\]"),
])
def test_a_group_the_plan_cannot_bridge_is_refused_naming_both_sides(group, heads, match):
    with pytest.raises(TransferError, match=match):
        group.rank_layouts(LOCAL, heads, "decode worker d")


@pytest.mark.parametrize("blob", [b"{", b'{"magic":"pdserve-kv-group","version":9,"ranks":[]}',
                                  b'{"magic":"pdserve-kv-group","version":1,"ranks":[],"num_kv_heads":2,"layout":""}',
                                  b'{"magic":"pdserve-kv-group","version":1,"ranks":[{"x":1}],"num_kv_heads":2,"layout":""}'])
def test_malformed_groups_raise_transfer_error(blob):
    with pytest.raises(TransferError):
        GroupEndpoint.from_bytes(blob)
