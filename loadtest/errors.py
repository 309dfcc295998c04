"""Typed errors of the load-test harness."""

from __future__ import annotations


class LoadTestError(Exception):
    """Base of every error the harness raises on purpose."""


class ConfigError(LoadTestError, ValueError):
    """A benchmark option is out of range or inconsistent."""


class DatasetError(LoadTestError):
    """A dataset could not be loaded or yielded no usable request."""


class ServerError(LoadTestError):
    """The target server failed the ready check (first request)."""
