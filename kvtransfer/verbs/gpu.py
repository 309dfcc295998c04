"""GPU memory for the verbs engine: register a CUDA KV pool for GPUDirect RDMA, and make the
bytes that arrived visible to CUDA kernels.

Registration (:func:`register_cuda`), in the order current stacks prefer:

1. dma-buf. ``cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`` exports
   the allocation holding the tensor as a dma-buf fd; pyverbs' ``DmaBufMR(pd, length, access,
   dmabuf=fd, offset=off)`` calls ``ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd,
   access)`` (rdma-core ``pyverbs/mr.pyx``). The MR's address space is its iova, i.e. ``offset``:
   the region is advertised at ``addr=offset``, and remote writes and local SGEs use
   ``offset + position``, never the device pointer.
2. nvidia-peermem. A plain ``ibv_reg_mr`` on the device pointer; the ``nvidia_peermem`` kernel
   module lets the RDMA driver pin GPU pages. The region is advertised at the device pointer.

Neither works: ``GpuRegistrationError`` naming both paths and why each failed.

Visibility (:func:`flush_gpudirect_writes`): a CQE says the NIC finished writing, not that the
GPU will observe the bytes in order with later kernel launches; CUDA's
``cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)`` is the documented fence (CUDA driver API, "GPUDirect
RDMA" section). The receiver calls it after a slot's count completes, before compute reads.

Needs a CUDA device and the CUDA driver library (``libcuda.so.1``); nothing here runs without one.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from kvtransfer.errors import GpuRegistrationError

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")


@dataclass(frozen=True, slots=True)
class GpuRegistration:
    """A registered GPU range: the pyverbs MR, the address peers and SGEs use for its first
    byte (``iova``: the dma-buf offset, or the device pointer), and which path made it."""

    mr: object
    iova: int
    path: str   # "dma-buf" or "nvidia-peermem"


def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GpuRegistrationError(f"the CUDA driver library libcuda.so.1 is not loadable: {exc}") from exc


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise GpuRegistrationError(f"{what} failed: CUDA error {rc} {name.value.decode() if name.value else ''}")


def peermem_loaded() -> bool:
    """True when an nvidia-peermem kernel module is loaded."""
    return any(os.path.isdir(f"/sys/module/{m}") for m in PEERMEM_MODULES)


def dmabuf_supported(device_index: int) -> bool:
    """True when the CUDA driver reports dma-buf export for the device; False without CUDA."""
    try:
        lib = _libcuda()
        value = ctypes.c_int(0)
        dev = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), device_index) != 0:
            return False
        rc = lib.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev)
        return rc == 0 and value.value == 1
    except (GpuRegistrationError, AttributeError):
        return False


def allocation_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``(base address, bytes)`` of the CUDA allocation holding ``tensor`` (``cuMemGetAddressRange``:
    a caching allocator's tensor may start inside a larger allocation; dma-buf export and CUDA IPC
    handles name whole allocations). Raises GpuRegistrationError."""
    lib = _libcuda()
    torch.cuda.set_device(tensor.device)   # the runtime makes the primary context current
    ptr = ctypes.c_uint64(tensor.data_ptr())
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    _check(lib, lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return base.value, size.value


def _dmabuf_fd(tensor: torch.Tensor) -> tuple[int, int]:
    """(dma-buf fd of the allocation holding ``tensor``, byte offset of the tensor in it)."""
    lib = _libcuda()
    base_addr, nbytes = allocation_range(tensor)
    base, size = ctypes.c_uint64(base_addr), ctypes.c_size_t(nbytes)
    fd = ctypes.c_int(-1)
    _check(lib, lib.cuMemGetHandleForAddressRange(ctypes.byref(fd), base, size,
                                                  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ctypes.c_ulonglong(0)),
           "cuMemGetHandleForAddressRange(DMA_BUF_FD)")
    return fd.value, tensor.data_ptr() - base_addr


def register_cuda(pd: object, tensor: torch.Tensor, access: int) -> GpuRegistration:
    """Register a contiguous CUDA tensor (see the module docstring for the two paths).

    Raises ``GpuRegistrationError`` naming both paths when neither works.
    """
    from pyverbs.mr import MR, DmaBufMR

    length = tensor.numel() * tensor.element_size()
    failures = []
    try:
        fd, offset = _dmabuf_fd(tensor)
        try:
            mr = DmaBufMR(pd, length, access, dmabuf=fd, offset=offset)
        finally:
            os.close(fd)   # the MR holds its own reference to the dma-buf
        return GpuRegistration(mr, offset, "dma-buf")
    except Exception as exc:   # noqa: BLE001 - recorded, then the next path
        failures.append(f"dma-buf (ibv_reg_dmabuf_mr): {exc}")
    try:
        mr = MR(pd, length, access, address=tensor.data_ptr())
        return GpuRegistration(mr, tensor.data_ptr(), "nvidia-peermem")
    except Exception as exc:   # noqa: BLE001
        hint = "" if peermem_loaded() else " (the nvidia_peermem module is not loaded: modprobe nvidia-peermem)"
        failures.append(f"nvidia-peermem (ibv_reg_mr on the device pointer): {exc}{hint}")
    raise GpuRegistrationError("cannot register CUDA memory for GPUDirect RDMA: " + "; ".join(failures))


def flush_gpudirect_writes(device: torch.device) -> None:
    """Order completed GPUDirect RDMA writes before later work on ``device`` (see the module
    docstring). Raises ``GpuRegistrationError`` when the driver refuses."""
    lib = _libcuda()
    torch.cuda.set_device(device)
    _check(lib, lib.cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                               CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER),
           "cuFlushGPUDirectRDMAWrites")
