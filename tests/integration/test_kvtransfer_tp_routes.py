"""Writes between tensor-parallel groups over each engine (`worker.tp_rank` over `kvtransfer.tp`),
without a model: every writer rank and every reader rank is an engine of its own in this process,
with its own registered pool (with verbs its own MR and QPs: writers on rxe0, readers on rxe1 in
the lab). For (writer TP, reader TP) = (2, 1) and (1, 2) on every engine, and (2, 4), (4, 2) and
(4, 1) over tcp, each reader rank's pool ends up holding exactly its KV heads of the blocks
written, and nothing else; each reader rank receives the immediates of its own routes, and all
of them add up to `count_job_writes`, the count the decode worker waits for.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from kvtransfer import ImmediateQueue, KVLayout, allocate_shared_buffer, create_engine, pack_immediate
from kvtransfer.group import GroupEndpoint
from kvtransfer.layout import POOL_LAYOUT
from kvtransfer.tp import plan_route_writes, rank_heads
from kvtransfer_helpers import engine_config
from test_kvtransfer_contract import _overrides
from worker.tp_rank import connect_group, count_job_writes, disconnect_group, post_layers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

KV_HEADS, LAYERS, BS, HEAD_DIM = 4, 3, 16, 8
SRC_BLOCKS, DST_BLOCKS = 24, 32
SRC, DST = [3, 4, 5, 10, 11, 0], [7, 8, 9, 20, 21, 31]   # runs of 3, 2 and 1 block on both sides
MAX_WRITE = 1 << 20
SETUPS = {"tcp": "tcp", "shm": "shm", "verbs": "verbs-2dev"}
CASES = [pytest.param(engine, a, b, marks=[pytest.mark.rdma] if engine == "verbs" else [], id=f"{engine}-{a}-{b}")
         for engine in SETUPS for a, b in ((2, 1), (1, 2))] + [
         pytest.param("tcp", a, b, id=f"tcp-{a}-{b}") for a, b in ((2, 4), (4, 2), (4, 1))]


def _layout(heads: int, blocks: int) -> KVLayout:
    return KVLayout(LAYERS, blocks, BS, heads, HEAD_DIM, 4)


@pytest.mark.parametrize("engine,a,b", CASES)
def test_each_reader_rank_gets_its_heads_and_counts_its_routes(engine, a, b):
    torch.manual_seed(a * 10 + b)
    model_kv = torch.randn(LAYERS, 2, KV_HEADS, SRC_BLOCKS, BS, HEAD_DIM)   # the whole model's
    writers, readers, inboxes, pools, shared = [], [], [], [], []
    try:
        for d in range(b):
            first, count = rank_heads(KV_HEADS, d, b)
            nbytes = _layout(count, DST_BLOCKS).total_bytes
            raw, shm = allocate_shared_buffer(nbytes)
            shared.append(shm)
            inboxes.append(ImmediateQueue())
            rx = create_engine(engine, engine_config(**_overrides(SETUPS[engine], 0)), arrivals=inboxes[-1])
            readers.append(rx)
            rx.register_memory(raw[:nbytes], shared=shm)
            pools.append(raw[:nbytes].view(torch.float32).view(LAYERS, 2, count, DST_BLOCKS, BS, HEAD_DIM))
        group = GroupEndpoint(tuple(rx.describe() for rx in readers), KV_HEADS, POOL_LAYOUT)
        peers, handles, imm = [], [], pack_immediate(5, 1)
        for r in range(a):
            first, count = rank_heads(KV_HEADS, r, a)
            src = model_kv[:, :, first:first + count].contiguous()
            tx = create_engine(engine, engine_config(**_overrides(SETUPS[engine], 1)))
            writers.append((tx, src))
            region = tx.register_memory(src.view(-1).view(torch.uint8))
            peer = connect_group(tx, GroupEndpoint.from_bytes(group.to_bytes()), _layout(count, SRC_BLOCKS),
                                 KV_HEADS, r, a, "the readers")
            peers.append(peer)
            for layer in range(LAYERS):
                posted, _ = post_layers(tx, region, _layout(count, SRC_BLOCKS), peer, SRC, DST, imm, MAX_WRITE,
                                        (layer,))
                handles += [(tx, h) for h in posted]
        for tx, h in handles:
            tx.wait(h, timeout_s=60)
        src_layout = _layout(rank_heads(KV_HEADS, 0, a)[1], SRC_BLOCKS)
        expect = [sum(len(plan_route_writes(src_layout, peers[0].layouts[d], route, SRC, DST, MAX_WRITE))
                      for route in peers[0].routes if route.dst_rank == d) for d in range(b)]
        assert sum(expect) == count_job_writes(src_layout, peers[0], SRC, DST, MAX_WRITE) == 2 * LAYERS * KV_HEADS * 3   # 3 runs
        for d in range(b):
            got, deadline = 0, time.monotonic() + 30
            while got < expect[d] and time.monotonic() < deadline:
                try:
                    assert inboxes[d].immediates.get(timeout=0.5)[0] == imm
                    got += 1
                except queue.Empty:
                    pass
            assert got == expect[d] and inboxes[d].immediates.empty(), (d, got, expect[d])
            first, count = rank_heads(KV_HEADS, d, b)
            want = model_kv[:, :, first:first + count, SRC]
            assert torch.equal(pools[d][:, :, :, DST], want), d
            untouched = [i for i in range(DST_BLOCKS) if i not in DST]
            assert not pools[d][:, :, :, untouched].any(), d
        for (tx, _), peer in zip(writers, peers):
            disconnect_group(tx, peer)
    finally:
        for tx, _ in writers:
            tx.close()
        for rx in readers:
            rx.close()
        for shm in shared:
            shm.close()
