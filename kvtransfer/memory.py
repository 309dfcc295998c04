"""Registered memory: keys, host views and bounds checks shared by the software engines."""

from __future__ import annotations

import ctypes
import secrets
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.endpoint import MemoryRegion
from kvtransfer.errors import RemoteAccessError, TransferError


@dataclass(frozen=True, slots=True)
class Registration:
    """A region plus a writable uint8 view of its bytes and the object keeping them alive.

    A staged registration (`kvtransfer.staging`) also has ``home``, the flat uint8 tensor (on a
    GPU) whose bytes the registered ones mirror, and ``mirror``, the registered bytes as a tensor."""

    region: MemoryRegion
    view: np.ndarray
    owner: object
    shared: object | None = None
    home: torch.Tensor | None = None
    mirror: torch.Tensor | None = None


def host_view(memory: torch.Tensor | tuple[int, int]) -> tuple[int, int, np.ndarray, object]:
    """``(addr, length, uint8 view, owner)`` of a contiguous host tensor or an ``(addr, length)``.

    Raises ``TransferError`` for CUDA or non-contiguous tensors and empty ranges.
    """
    if isinstance(memory, torch.Tensor):
        if memory.device.type != "cpu":
            raise TransferError(f"this engine needs host memory, got a {memory.device} tensor")
        if not memory.is_contiguous():
            raise TransferError("registered tensors must be contiguous")
        addr, length, owner = memory.data_ptr(), memory.numel() * memory.element_size(), memory
    else:
        addr, length = memory
        owner = None
    if length <= 0 or addr <= 0:
        raise TransferError(f"cannot register an empty or null range ({addr:#x}, {length})")
    view = np.frombuffer((ctypes.c_uint8 * length).from_address(addr), dtype=np.uint8)
    return addr, length, view, owner


class MemoryTable:
    """Key -> registration, with bounds checks. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[int, Registration] = {}
        self.has_staged = False   # a staged registration was made: writers stage their sources

    def register(self, memory: torch.Tensor | tuple[int, int], shared: object | None = None,
                 key: int | None = None, home: torch.Tensor | None = None) -> Registration:
        """Register ``memory`` (host bytes) under a new random key (or ``key``); ``home``: the
        tensor it mirrors (a staged registration: ``memory`` must then be a uint8 tensor of the
        same length). Raises TransferError (CUDA or non-contiguous memory, a taken key)."""
        addr, length, view, owner = host_view(memory)
        if home is not None and (not isinstance(memory, torch.Tensor) or home.numel() != length):
            raise TransferError("a staged registration's mirror is a tensor as long as its home")
        with self._lock:
            key = self._free_key(key)
            reg = Registration(MemoryRegion(addr, length, key), view, owner, shared, home,
                               memory if home is not None else None)
            self.has_staged = self.has_staged or home is not None
            self._by_key[key] = reg
            return reg

    def _free_key(self, key: int | None) -> int:
        """``key`` if free (TransferError if taken), else a new random nonzero key; under the lock."""
        if key is None:
            key = secrets.randbits(32)
            while key == 0 or key in self._by_key:
                key = secrets.randbits(32)
        elif key in self._by_key:
            raise TransferError(f"memory key {key:#x} already registered")
        return key

    def register_device(self, tensor: torch.Tensor, shared: object, key: int | None = None) -> Registration:
        """Register a contiguous device tensor that this process never reads through a host view
        (cuda_ipc: peers copy into it on the device); ``shared`` is its export. Raises TransferError."""
        if not tensor.is_contiguous():
            raise TransferError("registered tensors must be contiguous")
        length = tensor.numel() * tensor.element_size()
        with self._lock:
            key = self._free_key(key)
            reg = Registration(MemoryRegion(tensor.data_ptr(), length, key), np.empty(0, np.uint8), tensor, shared)
            self._by_key[key] = reg
            return reg

    def deregister(self, key: int) -> Registration | None:
        with self._lock:
            return self._by_key.pop(key, None)

    def get(self, key: int) -> Registration | None:
        with self._lock:
            return self._by_key.get(key)

    def regions(self) -> tuple[MemoryRegion, ...]:
        with self._lock:
            return tuple(r.region for r in self._by_key.values())

    def max_length(self) -> int:
        """Bytes of the largest registered region (0 when none): no write can be longer."""
        with self._lock:
            return max((r.region.length for r in self._by_key.values()), default=0)

    def registrations(self) -> tuple[Registration, ...]:
        with self._lock:
            return tuple(self._by_key.values())

    def slice(self, key: int, offset: int, length: int) -> np.ndarray:
        """The view ``[offset, offset + length)`` of region ``key``.

        Raises ``RemoteAccessError`` for an unknown key or a range outside the region.
        """
        reg = self.get(key)
        if reg is None:
            raise RemoteAccessError(f"unknown memory key {key:#x}")
        check_bounds(reg.region, offset, length)
        return reg.view[offset:offset + length]


class ViewCache:
    """Per-batch cache of ``key -> memoryview`` (one table lookup per distinct key); slices are
    memoryviews (cheap to cut, usable as iovecs and as memcpy sources)."""

    def __init__(self, table: MemoryTable) -> None:
        self._table = table
        self._views: dict[int, memoryview] = {}

    def view(self, key: int) -> memoryview:
        """The whole region ``key`` as a byte memoryview; ``RemoteAccessError`` if unknown."""
        view = self._views.get(key)
        if view is None:
            reg = self._table.get(key)
            if reg is None:
                raise RemoteAccessError(f"unknown memory key {key:#x}")
            view = self._views[key] = memoryview(reg.view)
        return view

    def slice(self, key: int, offset: int, length: int) -> memoryview:
        view = self.view(key)
        if offset < 0 or length <= 0 or offset + length > len(view):
            raise RemoteAccessError(f"range [{offset}, {offset + length}) outside region of {len(view)} bytes")
        return view[offset:offset + length]


def check_bounds(region: MemoryRegion, offset: int, length: int) -> None:
    """``RemoteAccessError`` unless ``[offset, offset + length)`` lies inside ``region``."""
    if offset < 0 or length <= 0 or offset + length > region.length:
        raise RemoteAccessError(
            f"range [{offset}, {offset + length}) outside region of {region.length} bytes (key {region.key:#x})")
