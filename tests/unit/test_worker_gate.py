"""worker.gate.StepGate: a busy loop lets waiting RPC threads in between its steps."""

from __future__ import annotations

import threading
import time

import pytest

from worker.gate import StepGate

pytestmark = pytest.mark.unit


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_waiting_thread_enters_before_the_loop_steps_again():
    gate = StepGate()
    order: list[str] = []

    def rpc() -> None:
        with gate:
            order.append("rpc")

    for _ in range(20):   # the loop re-enters right after yielding; the RPC must win every time
        order.clear()
        gate.__enter__()                     # the loop, mid-step
        t = threading.Thread(target=rpc, name="test-rpc")
        t.start()
        _wait_for(lambda: gate.waiting == 1)
        gate.__exit__()
        gate.yield_to_waiters()
        with gate:
            order.append("loop")
        t.join(5)
        assert not t.is_alive() and order == ["rpc", "loop"]
    assert gate.waiting == 0


def test_yield_is_bounded_when_waiters_cannot_enter():
    gate = StepGate(max_yield_s=0.05)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with gate:
            held.set()
            release.wait(10)

    threads = [threading.Thread(target=holder, name="test-holder")]
    threads[0].start()
    held.wait(5)
    threads.append(threading.Thread(target=lambda: gate.__enter__() or gate.__exit__(), name="test-waiter"))
    threads[1].start()
    _wait_for(lambda: gate.waiting == 1)
    t0 = time.monotonic()
    gate.yield_to_waiters()   # the waiter cannot get in while the holder sleeps
    assert 0.04 <= time.monotonic() - t0 < 2.0
    release.set()
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def test_condition_wait_and_notify():
    gate = StepGate()
    woke = threading.Event()

    def sleeper() -> None:
        with gate:
            if gate.wait(5):
                woke.set()

    t = threading.Thread(target=sleeper, name="test-sleeper")
    t.start()
    time.sleep(0.05)
    with gate:
        gate.notify_all()
    t.join(5)
    assert woke.is_set()
