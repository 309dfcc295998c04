"""A lock that a busy loop cannot monopolise.

The decode worker's loop holds its lock for a whole model step and takes it again right after.
With a plain lock, a thread that never slept wins every race against one that was woken when the
lock was released (the waker is already running; the woken thread still has to be scheduled), so
for as long as requests run, RPC threads (Abort, the heartbeat's load report, Stats) can wait for
seconds — long enough for the router to declare the worker dead. :class:`StepGate` counts the
threads waiting to enter, and the loop calls :meth:`StepGate.yield_to_waiters` between steps so
they go first.
"""

from __future__ import annotations

import threading
import time


class StepGate:
    """A ``threading.Condition`` (``with gate:``, ``wait``, ``notify_all``) with a count of the
    threads waiting to enter.

    Args:
        max_yield_s: the longest :meth:`yield_to_waiters` waits for waiters (seconds), so a
            stream of arrivals cannot stall the loop.
    """

    def __init__(self, max_yield_s: float = 0.05) -> None:
        self._cond = threading.Condition()
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._max_yield_s = max_yield_s

    def __enter__(self) -> "StepGate":
        with self._count_lock:
            self._waiting += 1
        try:
            self._cond.acquire()
        finally:
            with self._count_lock:
                self._waiting -= 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._cond.release()

    @property
    def waiting(self) -> int:
        """Threads blocked entering the gate now."""
        return self._waiting

    def wait(self, timeout_s: float | None = None) -> bool:
        """``Condition.wait``: release, sleep until notified or ``timeout_s`` (seconds), re-enter."""
        return self._cond.wait(timeout_s)

    def notify_all(self) -> None:
        self._cond.notify_all()

    def yield_to_waiters(self) -> None:
        """Called by the loop *outside* the gate: sleep in 0.1 ms steps while other threads are
        waiting to enter, up to ``max_yield_s``."""
        deadline = time.monotonic() + self._max_yield_s
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.0001)
