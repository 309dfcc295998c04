"""Typed errors of the KV data plane.

Every failure that crosses the ``kvtransfer`` boundary is one of these, so callers can tell a
timeout (retry elsewhere, free after confirmation) from an auth failure (misconfiguration) from a
remote access error (a bug in planning or a stale descriptor).
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error raised by ``kvtransfer``."""


class TransferError(KVTransferError):
    """A transfer failed: peer died, connection lost, slot failed, engine closed."""


class TransferTimeout(TransferError):
    """A wait passed its deadline (a slot's transfer deadline or a ``wait(timeout)``)."""


class AuthError(TransferError):
    """The shared-secret handshake failed (wrong secret, protocol mismatch, not authenticated)."""


class RemoteAccessError(TransferError):
    """A write named an unknown memory key or fell outside the registered region.

    Nothing of the rejected write was applied to the remote buffer.
    """


class PeerLostError(TransferError):
    """The connection to a peer ended while transfers could still be in flight."""


class PlanError(KVTransferError, ValueError):
    """Invalid planning input: mismatched layouts, block ids out of range, length mismatch."""


class EngineUnavailableError(KVTransferError):
    """The requested engine cannot run here (missing module, no device, unknown name)."""


class NoRdmaDeviceError(EngineUnavailableError):
    """pyverbs imports but the host has no usable RDMA device."""


class GpuRegistrationError(TransferError):
    """GPU memory could not be registered for RDMA by either GPUDirect path: dma-buf
    (``ibv_reg_dmabuf_mr``: needs a GPU driver and kernel with dma-buf export, CUDA >= 11.7 and
    an RDMA driver with dma-buf import) or nvidia-peermem (the ``nvidia_peermem`` kernel module).
    The message carries each path's own failure."""
