"""The verbs engine's registered memory: one MR per region (host memory through ``ibv_reg_mr``,
CUDA memory through :mod:`kvtransfer.verbs.gpu`), looked up by region key when a write is posted.

Host regions are also entered in the shared memory table, so the shm engine of ``auto`` sees
them. ``close()`` deregisters and closes every MR; the protection domain must outlive it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvtransfer.base import Memory, WriteOp
from kvtransfer.connection import Shared
from kvtransfer.endpoint import MemoryRegion
from kvtransfer.errors import RemoteAccessError, TransferError
from kvtransfer.verbs.device import Device
from kvtransfer.verbs.support import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE


@dataclass(frozen=True, slots=True)
class RegisteredMr:
    mr: object
    region: MemoryRegion
    lkey: int
    cuda: torch.device | None = None


class MemoryTable:
    """Region key -> :class:`RegisteredMr`; thread-safe."""

    def __init__(self, device: Device, shared: Shared) -> None:
        self._dev, self._s = device, shared
        self._lock = threading.Lock()
        self._mrs: dict[int, RegisteredMr] = {}

    def register(self, memory: Memory, shared: object | None) -> MemoryRegion:
        """See :meth:`VerbsEngine.register_memory`."""
        if isinstance(memory, torch.Tensor) and not memory.is_contiguous():
            raise TransferError("registered tensors must be contiguous")
        if isinstance(memory, torch.Tensor) and memory.device.type == "cuda":
            from kvtransfer.verbs.gpu import register_cuda
            reg = register_cuda(self._dev.pd, memory, ACCESS)
            length = memory.numel() * memory.element_size()
            entry = RegisteredMr(reg.mr, MemoryRegion(reg.iova, length, int(reg.mr.rkey)), int(reg.mr.lkey),
                                 memory.device)
        else:
            entry = self._register_host(memory)
            try:
                self._s.memory.register(memory, shared, key=entry.region.key)
            except BaseException:
                entry.mr.close()
                raise
        with self._lock:
            self._mrs[entry.region.key] = entry
        return entry.region

    def _register_host(self, memory: Memory) -> RegisteredMr:
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError

        if isinstance(memory, torch.Tensor):
            if memory.device.type != "cpu":
                raise TransferError(f"the verbs engine cannot register {memory.device} memory")
            addr, length = memory.data_ptr(), memory.numel() * memory.element_size()
        else:
            addr, length = memory
        if length <= 0 or addr <= 0:
            raise TransferError(f"cannot register an empty or null range ({addr:#x}, {length})")
        try:
            mr = MR(self._dev.pd, length, ACCESS, address=addr)
        except PyverbsError as exc:
            raise TransferError(f"ibv_reg_mr of {length} bytes failed: {exc} (is the memlock limit high "
                                "enough? ulimit -l, or docker --ulimit memlock=-1)") from exc
        return RegisteredMr(mr, MemoryRegion(addr, length, int(mr.rkey)), int(mr.lkey))

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            entry = self._mrs.pop(region.key, None)
        self._s.memory.deregister(region.key)
        if entry is not None:
            entry.mr.close()

    def regions(self) -> tuple[MemoryRegion, ...]:
        with self._lock:
            return tuple(m.region for m in self._mrs.values())

    def cuda_devices(self) -> set[torch.device]:
        with self._lock:
            return {m.cuda for m in self._mrs.values() if m.cuda is not None}

    def sources(self, ops: list[WriteOp] | tuple[WriteOp, ...]) -> list[RegisteredMr]:
        """The local MR of each op, its range checked. Raises ``RemoteAccessError`` for an
        unregistered key or a range outside the region."""
        out = []
        with self._lock:
            for op in ops:
                local = self._mrs.get(op.local.key)
                if local is None:
                    raise RemoteAccessError(f"local region key {op.local.key:#x} is not registered")
                if op.local_offset < 0 or op.length <= 0 or op.local_offset + op.length > local.region.length:
                    raise RemoteAccessError(f"local range [{op.local_offset}, {op.local_offset + op.length}) "
                                            f"outside the region of {local.region.length} bytes")
                out.append(local)
        return out

    def close(self) -> None:
        with self._lock:
            mrs, self._mrs = list(self._mrs.values()), {}
        for entry in mrs:
            self._s.memory.deregister(entry.region.key)
            entry.mr.close()
