"""The driver side of GPUDirect registration on a GPU host without an RDMA NIC (the GPU machine's
case; cuda marker: skipped with the reason without a GPU, a failure under
``PDSERVE_REQUIRE=cuda``). What `kvtransfer.verbs.gpu.register_cuda` does before it reaches the
NIC: the allocation range of a pool view, the dma-buf export of it (or, where the driver reports no
dma-buf support, the typed error naming the call), and the GPUDirect flush the decode side issues
after a count completes. The NIC half runs in tests/integration/test_verbs_gpu.py (rdma and cuda)."""

from __future__ import annotations

import os

import pytest
import torch

from kvtransfer.errors import GpuRegistrationError
from tests.require import unavailable

pytestmark = [pytest.mark.integration, pytest.mark.cuda]


def test_dmabuf_export_allocation_range_and_flush_without_a_nic():
    if not torch.cuda.is_available():
        unavailable("cuda", "no CUDA device: the GPUDirect driver paths cannot run here")
    from kvtransfer.verbs.gpu import _dmabuf_fd, allocation_range, dmabuf_supported, flush_gpudirect_writes

    pool = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    view = pool[4096:]
    base, size = allocation_range(view)
    assert base <= pool.data_ptr() < view.data_ptr() < base + size and allocation_range(pool) == (base, size)
    if dmabuf_supported(pool.device.index or 0):
        fd, offset = _dmabuf_fd(view)
        try:
            os.fstat(fd)   # a live descriptor (raises OSError otherwise)
            assert offset == view.data_ptr() - base
        finally:
            os.close(fd)
    else:
        with pytest.raises(GpuRegistrationError, match="cuMemGetHandleForAddressRange"):
            _dmabuf_fd(view)
    flush_gpudirect_writes(pool.device)   # no writes to order: the driver accepts it, or a typed error says why
