"""Typed errors of the router. Each carries what the HTTP layer needs for an OpenAI error body.

The API turns a `RouterError` into ``{"error": {"message", "type", "param", "code"}}`` with
``status`` as the HTTP status; anything else becomes a 500 ``internal_error``.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class. ``status``: HTTP status; ``type``/``code``/``param``: OpenAI error fields."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(RouterError):
    """The request is malformed or asks for something this server cannot do (HTTP 400)."""

    status = 400
    type = "invalid_request_error"
    code = None


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus max_tokens does not fit the model's context (HTTP 400)."""

    code = "context_length_exceeded"


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


class CapacityTimeout(RouterError):
    """No decode worker had room for the request's KV before its deadline (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    code = "capacity_timeout"


class UpstreamError(RouterError):
    """Workers failed the request on every attempt (HTTP 502)."""

    status = 502
    type = "server_error"
    code = "upstream_error"
