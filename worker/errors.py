"""Typed errors of the worker services (both roles).

Each one maps to exactly one gRPC status in `worker.grpc_status` (the wire contract documented in
``rpc/pdserve.proto``); engine and data-plane errors map there too.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of the errors the worker services raise on purpose."""


class DrainingError(WorkerError):
    """The worker is draining and accepts no new requests (UNAVAILABLE)."""


class UnknownRequestError(WorkerError, KeyError):
    """No request (reservation, job) with that id in the state the call needs (NOT_FOUND)."""

    def __str__(self) -> str:   # KeyError quotes its argument
        return str(self.args[0]) if self.args else "unknown request"


class PrefillError(WorkerError):
    """A prefill job could not complete (UNAVAILABLE: retry on another pair)."""


class PrefillTimeout(PrefillError):
    """The job's lease expired (DEADLINE_EXCEEDED)."""


class PrefillAborted(PrefillError):
    """The job was aborted (ABORTED)."""


class WarmupDropped(PrefillError):
    """A prefix-cache warm-up was not run: a prefill needed the room, or the worker stopped."""


class CacheDisabledError(WorkerError):
    """The call needs the prefix cache, which this worker runs without (FAILED_PRECONDITION)."""

