"""The one exception -> gRPC status table of both worker services.

The contract it implements (what each code means, which ones the router retries) is documented
at the top of ``rpc/pdserve.proto``; the router's typed clients (`router.clients`) read the codes
back. Servicer methods wear `unary` or `stream`: a typed exception raised inside becomes
``context.abort(code, message)``; anything else is a bug, logged with its traceback and answered
INTERNAL, and fails that call alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from engine.errors import CapacityError, InvalidRequestError
from kvtransfer import AuthError, KVTransferError, PeerLostError, PlanError, TransferTimeout
from worker.errors import (CacheDisabledError, DrainingError, PrefillAborted, PrefillError,
                           PrefillTimeout, UnknownRequestError)

log = logging.getLogger(__name__)

# First match wins: subclasses before their bases.
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),   # ContextLengthError included
    (PlanError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (CacheDisabledError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    (PrefillTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PrefillAborted, grpc.StatusCode.ABORTED),
    (AuthError, grpc.StatusCode.PERMISSION_DENIED),
    (PeerLostError, grpc.StatusCode.UNAVAILABLE),
    (PrefillError, grpc.StatusCode.UNAVAILABLE),
    (KVTransferError, grpc.StatusCode.ABORTED),
)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status ``exc`` is answered with (INTERNAL when it is none of the table's types)."""
    for kind, code in STATUS_TABLE:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, name: str, exc: Exception) -> None:
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", name)
        message = f"internal error in {name}: {type(exc).__name__}: {exc}"
    else:
        message = str(exc) or type(exc).__name__
    await context.abort(code, message)


def unary(fn: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Decorate an async unary servicer method with the status table."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, fn.__name__, exc)

    return wrapper


def stream(fn: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
    """Decorate an async-generator (server-streaming) servicer method with the status table."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, fn.__name__, exc)

    return wrapper
