"""The admission queue: bounded, FIFO, one waiter woken per release, fast refusal."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.admission import Admission
from router.errors import CapacityTimeout, Overloaded

pytestmark = pytest.mark.unit


class Capacity:
    """``units`` places; ``tries`` counts every try_place call, per request name."""

    def __init__(self, units: int = 0) -> None:
        self.units = units
        self.tries: dict[str, int] = {}

    def placer(self, name: str):
        async def try_place(since: float):
            self.tries[name] = self.tries.get(name, 0) + 1
            await asyncio.sleep(0)
            if self.units > 0:
                self.units -= 1
                return name
            return None
        return try_place


def test_places_at_once_when_nobody_waits():
    async def main():
        adm, cap = Admission(max_waiting=4, timeout_s=5), Capacity(units=1)
        assert await adm.acquire(cap.placer("a")) == "a"
        assert cap.tries == {"a": 1} and adm.waiting == 0
    asyncio.run(main())


def test_a_full_queue_refuses_at_once_with_retry_after():
    async def main():
        adm, cap = Admission(max_waiting=2, timeout_s=30, poll_s=10), Capacity()
        waiters = [asyncio.create_task(adm.acquire(cap.placer(n))) for n in "ab"]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as err:
            await adm.acquire(cap.placer("c"))
        assert time.monotonic() - t0 < 0.1
        assert err.value.status == 503 and err.value.headers()["Retry-After"].isdigit()
        assert adm.refused == 1
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert adm.waiting == 0
    asyncio.run(main())


def test_only_the_head_tries_and_one_release_wakes_one_waiter():
    async def main():
        adm, cap = Admission(max_waiting=100, timeout_s=30, poll_s=60), Capacity()
        names = [f"r{i}" for i in range(20)]
        tasks = [asyncio.create_task(adm.acquire(cap.placer(n))) for n in names]
        await asyncio.sleep(0.05)
        before = sum(cap.tries.values())
        cap.units = 1
        adm.notify()                      # one release
        done = await tasks[0]
        await asyncio.sleep(0.05)
        after = sum(cap.tries.values())
        assert done == "r0"
        # the head placed; the next head tried once (no capacity left); nobody else woke up
        assert after - before == 2, cap.tries
        assert all(cap.tries.get(n, 0) <= 1 for n in names[2:])
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
    asyncio.run(main())


def test_fifo_order_and_a_leaving_head_hands_over_its_turn():
    async def main():
        adm, cap = Admission(max_waiting=10, timeout_s=30, poll_s=60), Capacity()
        tasks = {n: asyncio.create_task(adm.acquire(cap.placer(n))) for n in "abc"}
        await asyncio.sleep(0.02)
        tasks["a"].cancel()               # the client at the head goes away
        await asyncio.gather(tasks["a"], return_exceptions=True)
        cap.units = 2
        adm.notify()
        assert await tasks["b"] == "b"
        assert await asyncio.wait_for(tasks["c"], 2) == "c"
    asyncio.run(main())


def test_waiting_longer_than_the_timeout_is_a_capacity_timeout():
    async def main():
        adm, cap = Admission(max_waiting=10, timeout_s=0.2, poll_s=0.05), Capacity()
        with pytest.raises(CapacityTimeout):
            await adm.acquire(cap.placer("a"))
        assert adm.waiting == 0
    asyncio.run(main())


def test_one_try_at_a_time_even_for_simultaneous_arrivals():
    """Two hundred requests arriving together must not all try at once (each try awaits a
    Reserve; concurrent tries would all see the same free capacity and overcommit it)."""
    async def main():
        adm = Admission(max_waiting=50, timeout_s=0.3, poll_s=0.05)
        active, peak, units = 0, 0, [5]

        async def try_place(since):
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.001)
            active -= 1
            if units[0] > 0:
                units[0] -= 1
                return True
            return None

        results = await asyncio.gather(*(adm.acquire(try_place) for _ in range(200)),
                                       return_exceptions=True)
        kinds = [type(r).__name__ if isinstance(r, BaseException) else r for r in results]
        assert peak == 1
        assert kinds.count(True) == 5
        assert kinds.count("CapacityTimeout") <= 50 and kinds.count("Overloaded") >= 200 - 5 - 50
        assert set(kinds) <= {True, "CapacityTimeout", "Overloaded"}
    asyncio.run(main())


def test_a_full_queue_is_refused_before_the_body_is_read():
    from engine.modelfile import resolve_model_path
    from engine.tokenizer import Tokenizer

    """The HTTP layer asks `refuse_now` first: a burst is shed without parsing bodies."""
    import threading

    from fastapi.testclient import TestClient

    from router.api import build_state, create_app
    from router.config import RouterConfig
    from router.membership import Membership

    state = build_state(RouterConfig(max_waiting_requests=1, wait_for_workers_s=3.0),
                        Tokenizer.from_file(resolve_model_path(None)), 64, Membership(), "/m.gguf")
    with TestClient(create_app(state)) as client:
        first = {}
        waiter = threading.Thread(target=lambda: first.update(r=client.post(
            "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})), name="queued-request")
        waiter.start()   # no workers: it waits in the queue, which then is full
        deadline = time.monotonic() + 5
        while state.orchestrator.admission.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = client.post("/v1/completions", content=b"not even json",
                        headers={"content-type": "application/json"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"].isdigit()
        assert client.get("/v1/models").status_code == 200   # other routes are not shed
        waiter.join(10)
        assert first["r"].status_code == 503 and first["r"].json()["error"]["code"] == "no_workers"
