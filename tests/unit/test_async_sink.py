"""`worker.async_sink`: items handed from a worker thread to coroutines of an event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decode.sink import QueueSink
from worker.async_sink import AsyncSink, put_each

pytestmark = pytest.mark.unit


@pytest.fixture
def loop():
    """An event loop running in a thread of its own (named), stopped and closed after the test."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, name="test-sink-loop", daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)
    assert not t.is_alive()
    lp.close()


def test_put_each_hands_a_steps_items_to_each_loop_at_once_in_order(loop):
    """Three streams' items of two steps reach their coroutines in order, each step with one
    wake-up of the loop; a sink that is not an `AsyncSink` gets ``put``."""
    sinks = [AsyncSink(loop) for _ in range(3)]
    other = QueueSink()
    wakes = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakes.append(a[0]), real(*a))[1]
    for step in range(2):
        put_each([(s, (i, step)) for i, s in enumerate(sinks)] + [(other, ("other", step))])
    assert len(wakes) == 2

    async def read(sink):
        return [await sink.get(), await sink.get()]

    got = [asyncio.run_coroutine_threadsafe(read(s), loop).result(5) for s in sinks]
    assert got == [[(i, 0), (i, 1)] for i in range(3)]
    assert [other.items.get_nowait() for _ in range(2)] == [("other", 0), ("other", 1)]


def test_put_each_drops_items_for_a_closed_loop_and_delivers_the_rest(loop):
    closed = asyncio.new_event_loop()
    closed.close()
    gone, live = AsyncSink(closed), AsyncSink(loop)
    put_each([(gone, "lost"), (live, "kept")])
    assert asyncio.run_coroutine_threadsafe(live.get(), loop).result(5) == "kept"
