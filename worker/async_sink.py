"""Hand-off from worker threads to an RPC coroutine: `AsyncSink`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class AsyncSink:
    """A queue filled from any thread (``put`` never blocks) and read by coroutines of ``loop``.

    Items put after the loop closed (the server stopping) are dropped: nobody can read them.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:   # the loop is closed
            pass

    async def get(self):
        """The next item (waits)."""
        return await self._queue.get()

    def get_nowait(self):
        """The next item if one is there, else raises `asyncio.QueueEmpty`."""
        return self._queue.get_nowait()


def put_each(items: Iterable[tuple[object, object]]) -> None:
    """``sink.put(item)`` for each ``(sink, item)``, in order, with one wake-up of each event
    loop for all of its `AsyncSink` items (a decode step's tokens for every stream of the
    server's loop: one hand-off instead of one per sequence, each of which wakes the loop's
    thread). Other sinks get ``put`` as they come. Items for a loop that closed are dropped,
    as ``AsyncSink.put`` drops them."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for sink, item in items:
        if isinstance(sink, AsyncSink):
            by_loop.setdefault(sink._loop, []).append((sink._queue, item))
        else:
            sink.put(item)
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_pairs, pairs)
        except RuntimeError:   # the loop is closed
            pass


def _put_pairs(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in pairs:
        q.put_nowait(item)
