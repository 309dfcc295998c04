"""Argument checks shared by both worker services (run before any state is touched)."""

from __future__ import annotations

import math

from engine.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str) -> None:
    """Raise `InvalidRequestError` unless ``request_id`` is 1..256 printable characters."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequestError(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable characters")


def check_seconds(name: str, value: float) -> None:
    """Raise `InvalidRequestError` unless ``value`` is a finite number of seconds >= 0."""
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(f"{name} must be finite and >= 0 seconds, got {value}")
