"""Typed errors raised at the engine's boundaries.

Every error carries a human-readable message fit to return to a client. Callers translate them
at their own boundary (the router maps `InvalidRequestError` and its subclasses to HTTP 400).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (empty prompt, max_tokens < 1, bad sampling values)."""


class ChatTemplateError(InvalidRequestError):
    """The chat template rejected the messages (its ``raise_exception``) or failed on them, or the
    model has no template to render them with."""


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context window."""


class CapacityError(EngineError):
    """The KV pool (or another bounded resource) cannot hold what was asked for."""


class ModelLoadError(EngineError):
    """A model file or directory is missing, malformed, or of an unsupported architecture."""


class TokenizerError(EngineError):
    """The tokenizer or chat template could not be built or applied."""


class TensorParallelError(EngineError):
    """A tensor-parallel group lost a rank (it exited, or did not start): the group, and the
    worker it serves, cannot run another pass (`engine.tp_ranks`)."""
