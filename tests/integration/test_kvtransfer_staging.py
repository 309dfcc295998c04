"""Staged registrations over tcp and shm (`kvtransfer.staging`): the path a GPU pool takes over the
software engines, run here with host tensors as the homes (``stage=True``: the same copies, as
memcpys). The writer's home bytes (not its mirror's) reach the receiver's home (not only its
mirror) before the write's immediate is delivered; the copy schedule coalesces adjacent ranges.
On a GPU the same engines stage CUDA pools (tests/cuda).
"""

from __future__ import annotations


import pytest
import torch

from kvtransfer import KVLayout, create_engine, pack_immediate, plan_writes, to_write_ops
from kvtransfer.staging import copy_runs
from kvtransfer_helpers import engine_config

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(num_layers=2, num_blocks=24, block_size=16, num_kv_heads=2, head_dim=8, itemsize=4)


class _HomeCheck:
    """Arrival sink that checks, as each immediate arrives, that the receiver's home already
    holds the written blocks."""

    def __init__(self, check):
        self.check, self.seen, self.bad = check, 0, []

    def on_immediate(self, imm, source, count=1):
        if not self.check():
            self.bad.append(imm)
        self.seen += count

    def on_peer_lost(self, source, error):
        pass

    def on_peer_connected(self, source):
        pass

    def on_peer_gone(self, source):
        pass


def test_copy_runs_coalesces_touching_ranges_per_key():
    assert copy_runs([(1, 100, 50), (1, 0, 100), (2, 0, 10), (1, 150, 10), (1, 400, 8), (2, 5, 10)]) == [
        (1, 0, 160), (1, 400, 8), (2, 0, 15)]
    with pytest.raises(ValueError):
        copy_runs([(1, 0, 0)])


@pytest.mark.parametrize("engine", ["tcp", "shm", "auto"])   # auto: shm on one host, a shared mirror
def test_staged_homes_carry_the_bytes_before_the_immediate(engine):
    torch.manual_seed(0)
    src_home = torch.randn(LAYOUT.total_bytes // 4)
    dst_home = torch.zeros(LAYOUT.total_bytes // 4)
    src_blocks, dst_blocks = [0, 1, 2, 7], [5, 6, 7, 20]
    src_view = src_home.view(2, 2, 2, 24, 16, 8)
    dst_view = dst_home.view(2, 2, 2, 24, 16, 8)
    want = src_view[:, :, :, src_blocks]
    arrivals = _HomeCheck(lambda: torch.equal(dst_view[:, :, :, dst_blocks], want))
    rx = create_engine(engine, engine_config(), arrivals=arrivals)
    tx = create_engine(engine, engine_config())
    try:
        remote = rx.register_memory(dst_home, stage=True)
        local = tx.register_memory(src_home, stage=True)
        assert remote.addr != dst_home.data_ptr() and local.addr != src_home.data_ptr()   # mirrors
        peer = tx.connect(rx.describe())
        plan = plan_writes(LAYOUT, LAYOUT, src_blocks, dst_blocks, 1 << 20)
        ops = to_write_ops(plan, local, remote.key, pack_immediate(3, 1))
        tx.wait(tx.post_writes(peer, ops), timeout_s=30)
        assert arrivals.seen == len(ops) and not arrivals.bad
        assert torch.equal(dst_view[:, :, :, dst_blocks], want)
        others = [b for b in range(24) if b not in dst_blocks]
        assert not dst_view[:, :, :, others].any()
        mirrors = list(getattr(rx, "_mirrors", {}).values())
    finally:
        tx.close()
        rx.close()
    # closing released the mirrors (on a GPU: their cudaHostRegister pinning; shm: their memfd)
    if engine == "shm":
        assert mirrors and all(m.handle.fd == -1 for m in mirrors)
