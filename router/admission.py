"""Admission control: a bounded FIFO of requests waiting for cluster capacity.

A request is *placed* when its workers can take it now: on the disaggregated path a prefill
worker with room in its budget of in-flight prompt tokens and a decode worker whose ``Reserve``
succeeded; on the colocated path a decode worker under its in-flight limit. Placement is tried by
the orchestrator's ``try_place`` callback; this module only decides who tries, and when:

- One placement is tried at a time (a try awaits a ``Reserve`` call; concurrent tries would all
  see the same free capacity and overcommit it).
- With nobody waiting and no try under way, an arriving request tries at once.
- Otherwise it joins the queue, or, when ``max_waiting`` requests already wait, it is refused at
  once with `Overloaded` (HTTP 503 with ``Retry-After``).
- Only the head of the queue tries. It tries again when woken by `Admission.notify` (a request
  released capacity: a prefill ended, KV blocks were freed, a worker joined) — one waiter is
  woken per release, never the whole queue — or every ``poll_s`` (heartbeats may show capacity
  that no local release announced).
- A request that waited ``timeout_s`` fails with `CapacityTimeout` (503); a client that goes
  away leaves the queue at once. Leaving the head hands the turn to the next waiter.

Nothing is held while waiting: a decode reservation is only made at placement, so no lease
runs out while a request queues at the router (the alternative, reserving first and queueing at
the prefill worker, expired reservations under load and threw half the prefill work away).

Not thread safe: used from the HTTP event loop only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from router.errors import CapacityTimeout, Overloaded

T = TypeVar("T")


class Admission:
    """The admission queue.

    Args:
        max_waiting: requests that may wait at once (0: none; every request that cannot be
            placed at once is refused).
        timeout_s: longest wait in the queue (seconds).
        poll_s: how often the head retries without a wake-up (seconds).
    """

    def __init__(self, max_waiting: int, timeout_s: float, poll_s: float = 0.5) -> None:
        self.max_waiting, self.timeout_s, self.poll_s = max_waiting, timeout_s, poll_s
        self._waiters: deque[asyncio.Event] = deque()
        self._placing = False
        self._placed_at: deque[float] = deque(maxlen=64)   # recent placement times (retry hint)
        self.refused = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def refuse_now(self) -> Overloaded | None:
        """The `Overloaded` error a request arriving now would get for certain (it would have to
        queue, and the queue is full), or None. Lets the HTTP layer refuse before it even reads
        the request body."""
        if (self._waiters or self._placing) and len(self._waiters) >= self.max_waiting:
            return self._refuse()
        return None

    def _refuse(self) -> Overloaded:
        self.refused += 1
        return Overloaded(f"{len(self._waiters)} requests are already waiting for capacity; "
                          "try again later", retry_after_s=self.retry_after_s())

    async def acquire(self, try_place: Callable[[float], Awaitable[T | None]]) -> T:
        """Place a request: ``await try_place(since)`` (``since``: monotonic time the request
        arrived) returns what was placed, or None when there is no capacity now.

        Raises `Overloaded` (queue full), `CapacityTimeout` (waited ``timeout_s``), or whatever
        ``try_place`` raises.
        """
        since = time.monotonic()
        tried = not self._waiters and not self._placing
        if tried:
            placed = await self._try(try_place, since)
            if placed is not None:
                return self._placed(placed)
        if len(self._waiters) >= self.max_waiting:
            raise self._refuse()
        me = asyncio.Event()
        if tried:   # it arrived before everyone who queued during its try
            self._waiters.appendleft(me)
        else:
            self._waiters.append(me)
        try:
            while True:
                if self._waiters[0] is me and not tried and not self._placing:
                    placed = await self._try(try_place, since)
                    if placed is not None:
                        return self._placed(placed)
                left = since + self.timeout_s - time.monotonic()
                if left <= 0:
                    raise CapacityTimeout(f"no capacity for this request within {self.timeout_s:g}s")
                tried = False
                me.clear()
                try:
                    await asyncio.wait_for(me.wait(), min(left, self.poll_s))
                except asyncio.TimeoutError:
                    pass
        finally:
            head = self._waiters[0] is me
            self._waiters.remove(me)
            if head:
                self.notify()

    async def _try(self, try_place, since: float):
        self._placing = True
        try:
            return await try_place(since)
        finally:
            self._placing = False
            self.notify()   # a head that found a try under way gets its turn now

    def notify(self) -> None:
        """Capacity may have been released: wake the head of the queue (only)."""
        if self._waiters:
            self._waiters[0].set()

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the queue's length at the recent placement
        rate, between 1 and 60."""
        if len(self._placed_at) < 2:
            return 1
        span = self._placed_at[-1] - self._placed_at[0]
        rate = (len(self._placed_at) - 1) / span if span > 0 else float("inf")
        return int(min(60, max(1, math.ceil(len(self._waiters) / rate))))

    def _placed(self, placed: T) -> T:
        self._placed_at.append(time.monotonic())
        return placed
