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


async def wait_finished(job, timeout_s: float | None) -> bool:
    """Wait (without blocking the loop) until ``job`` (anything with ``add_done_callback(fn)``
    calling ``fn(job)`` once finished) finishes; False if ``timeout_s`` (None: no limit) passed
    first."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def _finished(_job) -> None:
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    job.add_done_callback(_finished)
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
