"""Device pools over the software engines (tcp, shm): staged through a host mirror.

tcp and shm move host bytes. A KV pool on a GPU is registered with them as a *staged*
registration: the engine allocates a host mirror of the pool (page-locked, so copies to and from
the device run as DMA; in shared memory when the shm engine may receive into it) and registers
the mirror, remembering the device tensor as the registration's *home*. Nothing changes on the
wire or for peers: a peer sees a region of the same length and writes into its offsets.

- Writer: just before a stream's tx thread sends a batch (`stage_out`), the batch's source ranges
  are copied device -> mirror on that thread's own CUDA stream, coalesced into runs
  (`copy_runs`), then the stream is synchronized and the bytes sent. The copy runs on the tx
  thread, so it overlaps the next layer's compute (the prefill loop already synchronized the
  layer's K/V before posting its writes) and the previous batch's socket time.
- Receiver: after a frame's payloads are in the mirror (`stage_in`), its accepted ranges are
  copied mirror -> device and synchronized before the frame's immediates are delivered, so an
  immediate still means "the bytes are where the reader computes from".

A home may also be a host tensor distinct from the registered bytes (``stage=True`` on the CPU):
the same copies run as plain memcpys, which is how the schedule is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvtransfer.errors import TransferError


def copy_runs(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce ``(key, offset, length)`` byte ranges into the fewest copies: ranges of one key
    that touch or overlap merge (sorted by key, then offset). Lengths must be positive."""
    out: list[list[int]] = []
    for key, offset, length in sorted(ranges):
        if length <= 0:
            raise ValueError(f"range length must be positive, got {length}")
        last = out[-1] if out else None
        if last is not None and last[0] == key and offset <= last[1] + last[2]:
            last[2] = max(last[2], offset + length - last[1])
        else:
            out.append([key, offset, length])
    return [tuple(r) for r in out]


class Mirror:
    """A staged registration's host mirror (`allocate_mirror`): ``tensor`` (uint8, as long as its
    home), ``handle`` (the shared-memory handle for shm, else None) and whether this process
    page-locked it with ``cudaHostRegister``. `release` undoes the pinning and closes the handle;
    the engine calls it when the registration or the engine goes away. Without it, a mapping
    freed later while still registered leaves CUDA's registration behind, and the next mapping
    at that address fails with error 712 (cudaErrorHostMemoryAlreadyRegistered)."""

    def __init__(self, tensor: torch.Tensor, handle=None, host_registered: bool = False):
        self.tensor, self.handle, self._registered = tensor, handle, host_registered

    def release(self) -> None:
        """Unregister the pinning (once) and close the handle; idempotent. Raises TransferError
        when CUDA refuses to unregister."""
        if self._registered:
            self._registered = False
            err = torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            if int(err) != 0:
                raise TransferError(f"cudaHostUnregister of a shared mirror failed: error {int(err)}")
        if self.handle is not None:
            self.handle.close()


def allocate_mirror(home: torch.Tensor, allocate_shared=None) -> Mirror:
    """A host mirror for ``home`` (a contiguous tensor); in shared memory when ``allocate_shared``
    (`kvtransfer.shm.allocate_shared_buffer`) is given; page-locked when ``home`` is on a GPU
    (pinned by torch, or, for shared memory, registered with ``cudaHostRegister`` until
    `Mirror.release`). Raises TransferError when pinning fails."""
    nbytes = home.numel() * home.element_size()
    if allocate_shared is not None:
        mirror, handle = allocate_shared(nbytes)
        if home.is_cuda:
            err = torch.cuda.cudart().cudaHostRegister(mirror.data_ptr(), nbytes, 0)
            if int(err) != 0:
                handle.close()
                raise TransferError(f"cudaHostRegister of a {nbytes}-byte shared mirror failed: error {int(err)}")
        return Mirror(mirror, handle, host_registered=home.is_cuda)
    return Mirror(torch.empty(nbytes, dtype=torch.uint8, pin_memory=home.is_cuda))


def home_bytes(home: torch.Tensor) -> torch.Tensor:
    """``home``'s bytes as a flat uint8 tensor (a view)."""
    if not home.is_contiguous():
        raise TransferError("registered tensors must be contiguous")
    return home.view(-1).view(torch.uint8)


class Stager:
    """Copies between registrations' mirrors and their homes (module doc), one per thread that
    copies (each has its own CUDA stream when homes are on a GPU). ``lookup(key)`` gives the
    `kvtransfer.memory.Registration` of a key, or None."""

    def __init__(self, lookup):
        self._lookup = lookup
        self._stream = None

    def _copy(self, runs: Sequence[tuple[int, int, int]], to_home: bool) -> None:
        cuda = False
        for key, offset, length in runs:
            reg = self._lookup(key)
            if reg is None or reg.home is None:
                continue
            home = reg.home[offset:offset + length]
            mirror = reg.mirror[offset:offset + length]
            if home.is_cuda:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=home.device)
                cuda = True
                with torch.cuda.stream(self._stream):
                    (home if to_home else mirror).copy_(mirror if to_home else home, non_blocking=True)
            else:
                (home if to_home else mirror).copy_(mirror if to_home else home)
        if cuda:
            self._stream.synchronize()

    def stage_out(self, ops) -> None:
        """Writer: copy the source ranges of ``ops`` (`kvtransfer.base.WriteOp`) whose local
        registration is staged from the home into the mirror; returns once they are there."""
        staged: dict[int, bool] = {}   # one table lookup per key
        ranges = []
        for op in ops:
            key = op.local.key
            if key not in staged:
                staged[key] = self._staged(key)
            if staged[key]:
                ranges.append((key, op.local_offset, op.length))
        if ranges:
            self._copy(copy_runs(ranges), to_home=False)

    def stage_in(self, descs: np.ndarray, status: np.ndarray) -> None:
        """Receiver: copy a frame's accepted ranges (`kvtransfer.frame.DESC_DTYPE` rows whose
        ``status`` is 0) of staged registrations from the mirror to the home; returns once
        they are there."""
        ok = descs[status == 0] if len(status) else descs
        self._copy(copy_runs((int(d["key"]), int(d["offset"]), int(d["length"])) for d in ok
                             if self._staged(int(d["key"]))), to_home=True)

    def _staged(self, key: int) -> bool:
        reg = self._lookup(key)
        return reg is not None and reg.home is not None
