"""Hand-off from worker threads to an RPC coroutine: `AsyncSink`."""

from __future__ import annotations

import asyncio


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
