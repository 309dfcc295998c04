"""GPUDirect parts of the verbs engine, which need a CUDA device and an RDMA device at once (they
skip here, with the reason, where either is missing; PDSERVE_REQUIRE=cuda makes that a failure):
dma-buf registration with the region advertised at the MR's iova, the nvidia-peermem fallback,
the typed error naming both paths, the GPUDirect flush after a count completes, and a CUDA pool
under ``auto`` advertising its region (the decode side)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer import CompletionCounter, EndpointInfo, EngineConfig, WriteOp, create_engine, pack_immediate
from kvtransfer.errors import GpuRegistrationError
from tests.require import unavailable

pytestmark = [pytest.mark.integration, pytest.mark.rdma, pytest.mark.cuda, pytest.mark.timeout(600)]
CFG = EngineConfig(secret=b"gpu-direct-test-secret-0123")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        unavailable("cuda", "no CUDA device: the GPUDirect paths (dma-buf, nvidia-peermem) cannot run here")


def test_cuda_pool_is_registered_and_written_by_gpudirect():
    from kvtransfer.verbs.gpu import dmabuf_supported, peermem_loaded
    pool = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 255, (1 << 22,), dtype=torch.uint8)
    counter = CompletionCounter(4)
    with create_engine("verbs", CFG, arrivals=counter) as rx, create_engine("verbs", CFG) as tx:
        try:
            region = rx.register_memory(pool)
        except GpuRegistrationError as exc:
            assert "dma-buf" in str(exc) and "nvidia-peermem" in str(exc)
            pytest.skip(f"no GPUDirect path on this host: {exc}")
        if dmabuf_supported(pool.device.index or 0):
            assert region.addr < pool.data_ptr()   # the dma-buf iova is the offset in the buffer, not a pointer
        else:
            assert peermem_loaded() and region.addr == pool.data_ptr()
        local = tx.register_memory(src)
        peer = tx.connect(rx.describe())
        slot, gen = counter.acquire(30)
        ops = [WriteOp(local, i << 20, region.key, i << 20, 1 << 20, pack_immediate(slot, gen)) for i in range(4)]
        tx.wait(tx.post_writes(peer, ops), 60)
        counter.expect(slot, gen, 4)
        counter.wait(slot, gen, 60)
        rx.flush_arrivals()   # cuFlushGPUDirectRDMAWrites before a kernel reads the pool
        assert torch.equal(pool.cpu(), src)


def test_cuda_pool_under_auto_advertises_its_region():
    pool = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    with create_engine("auto", CFG) as rx:
        if rx.primary.name != "verbs":
            pytest.skip(f"auto did not pick verbs: {rx.choice.reason}")
        try:
            region = rx.register_memory(pool)
        except GpuRegistrationError as exc:
            pytest.skip(f"no GPUDirect path on this host: {exc}")
        info = EndpointInfo.from_bytes(dataclasses.replace(rx.describe()).to_bytes())
        assert region in info.regions
