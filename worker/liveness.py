"""Liveness of a worker's loops: a dead or stalled loop makes the worker report itself unhealthy.

Each loop (``decode-loop``, ``prefill-loop``, ``prefill-sender``) owns a `LoopWatch`: it calls
:meth:`LoopWatch.tick` once per iteration, wraps its body in :meth:`LoopWatch.guard` (an exception
is logged and counted and the loop goes on), and the worker's heartbeat reports
``LoadStats.unhealthy`` with the reason from :func:`check` — the router stops routing to the
worker until a heartbeat says it is healthy again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager

log = logging.getLogger(__name__)


class LoopWatch:
    """Watches one loop thread.

    Args:
        name: the loop's name (the thread's name), used in reasons.
        stall_s: seconds without a tick after which the loop counts as stalled (longer than one
            iteration can legitimately take: a forward pass of the largest batch).
    """

    def __init__(self, name: str, stall_s: float = 30.0) -> None:
        self.name = name
        self.stall_s = stall_s
        self.errors = 0
        self._last_tick = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def attach(self, thread: threading.Thread) -> None:
        """The thread running the loop (checked for being alive)."""
        self._thread = thread

    def tick(self) -> None:
        """The loop is making progress (called once per iteration)."""
        self._last_tick = time.monotonic()

    def stopped(self) -> None:
        """The loop ended on purpose (close): not a failure."""
        self._stopped = True

    @contextmanager
    def guard(self, what: str):
        """Run one iteration's body: an exception is logged and counted, never propagated."""
        try:
            yield
        except Exception:
            self.errors += 1
            log.exception("%s: %s failed (error %d); the loop goes on", self.name, what, self.errors)

    def problem(self) -> str | None:
        """Why this loop is unhealthy, or None."""
        if self._stopped:
            return None
        if self._thread is not None and not self._thread.is_alive():
            return f"{self.name} thread died"
        idle = time.monotonic() - self._last_tick
        if idle > self.stall_s:
            return f"{self.name} made no progress for {idle:.0f}s"
        return None


def check(watches: Iterable[LoopWatch]) -> str | None:
    """The first problem among ``watches``, or None when all are healthy."""
    for w in watches:
        reason = w.problem()
        if reason is not None:
            return reason
    return None
