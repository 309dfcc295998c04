"""Where a decode request's outputs go: the `Sink` protocol and `QueueSink`, one over a queue."""

from __future__ import annotations

import queue
from typing import Protocol

from engine.generator import StepOutput
from kvtransfer import KVTransferError


class Sink(Protocol):
    """Where a request's outputs go: `StepOutput` items (the last has ``finish_reason``), or
    one `KVTransferError` when its transfer failed. ``put`` is called from the decode loop and
    RPC threads; it must not block."""

    def put(self, item: StepOutput | KVTransferError) -> None: ...


class QueueSink:
    """A `Sink` over a ``queue.SimpleQueue`` (tests and blocking readers)."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self.items.put(item)
