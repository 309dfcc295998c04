"""Typed errors of the router. Each carries what the HTTP layer needs for an OpenAI error body.

The API turns a `RouterError` into ``{"error": {"message", "type", "param", "code"}}`` with
``status`` as the HTTP status; anything else becomes a 500 ``internal_error``.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class. ``status``: HTTP status; ``type``/``code``/``param``: OpenAI error fields;
    ``retry_after_s``: sent as ``Retry-After`` (503 answers)."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    retry_after_s: int | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """HTTP headers of the error answer."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


class InvalidRequest(RouterError):
    """The request is malformed or asks for something this server cannot do (HTTP 400)."""

    status = 400
    type = "invalid_request_error"
    code = None


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus max_tokens does not fit the model's context (HTTP 400)."""

    code = "context_length_exceeded"


class RequestTooLarge(RouterError):
    """The request body exceeds ``max_request_bytes`` (HTTP 413)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ModelNotFound(RouterError):
    """The requested model is not served here (HTTP 404)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NoWorkers(RouterError):
    """No connected prefill/decode pair can take the request (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    code = "no_workers"
    retry_after_s = 5


class CapacityTimeout(RouterError):
    """The request waited its whole ``queue_timeout_s`` for capacity (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    code = "capacity_timeout"
    retry_after_s = 5


class Overloaded(RouterError):
    """The admission queue is full: refused at once (HTTP 503 with ``Retry-After``)."""

    status = 503
    type = "service_unavailable"
    code = "overloaded"
    retry_after_s = 1


class UpstreamError(RouterError):
    """Workers failed the request on every attempt (HTTP 502)."""

    status = 502
    type = "server_error"
    code = "upstream_error"
