from __future__ import annotations

import threading

import pytest

from kvtransfer import (CompletionCounter, PeerLostError, SlotState, TransferError, TransferTimeout,
                        pack_immediate)

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_slots=4, clock=None):
    done = []
    counter = CompletionCounter(num_slots, on_done=lambda s, g, st: done.append((s, g, st)),
                                **({"clock": clock} if clock else {}))
    return counter, done


def test_completes_exactly_once_when_count_reached():
    c, done = make()
    slot, gen = c.acquire(10)
    c.expect(slot, gen, 3)
    for _ in range(3):
        c.on_immediate(pack_immediate(slot, gen), "w")
    c.wait(slot, gen, 0)
    assert c.state(slot).state == SlotState.COMPLETE
    c.on_immediate(pack_immediate(slot, gen), "w")    # extra after completion: not counted again
    assert done == [(slot, gen, SlotState.COMPLETE)]
    assert c.stats().completed == 1 and c.stats().stale_dropped == 1


def test_arrivals_before_expected_count_is_known():
    c, done = make()
    slot, gen = c.acquire(10)
    for _ in range(5):
        c.on_immediate(pack_immediate(slot, gen), "w")
    assert c.state(slot).state == SlotState.PENDING and c.state(slot).received == 5
    c.expect(slot, gen, 5)
    assert c.state(slot).state == SlotState.COMPLETE
    assert done == [(slot, gen, SlotState.COMPLETE)]


def test_zero_writes_completes_on_expect():
    c, _ = make()
    slot, gen = c.acquire(10)
    c.expect(slot, gen, 0)
    c.wait(slot, gen, 0)


def test_more_writes_than_expected_fails():
    c, done = make()
    slot, gen = c.acquire(10)
    for _ in range(3):
        c.on_immediate(pack_immediate(slot, gen), "w")
    c.expect(slot, gen, 2)
    with pytest.raises(TransferError):
        c.wait(slot, gen, 0)
    assert done == [(slot, gen, SlotState.FAILED)]


def test_stale_generation_dropped_and_counted():
    c, _ = make(num_slots=1)
    slot, gen = c.acquire(10)
    c.release(slot, gen)
    slot2, gen2 = c.acquire(10)
    assert slot2 == slot and gen2 == (gen + 1) % 256
    c.on_immediate(pack_immediate(slot, gen), "w")
    c.on_immediate(pack_immediate(slot, (gen + 7) % 256), "w")
    assert c.state(slot).received == 0 and c.stats().stale_dropped == 2
    c.on_immediate(0xFFFFFFFF, "w")   # slot out of range
    assert c.stats().invalid_dropped == 1
    with pytest.raises(TransferError):
        c.expect(slot, gen, 1)            # stale generation
    with pytest.raises(TransferError):
        c.wait(slot, gen, 0)


def test_generation_wraps():
    c, _ = make(num_slots=1)
    gens = []
    for _ in range(257):
        slot, gen = c.acquire(10)
        gens.append(gen)
        c.release(slot, gen)
    assert gens[0] == gens[256] and len(set(gens)) == 256


def test_deadline_fails_slot_with_timeout():
    clock = FakeClock()
    c, done = make(clock=clock)
    slot, gen = c.acquire(5)
    c.expect(slot, gen, 2)
    c.on_immediate(pack_immediate(slot, gen), "w")
    assert c.expire_overdue() == []
    clock.now += 5
    assert c.expire_overdue() == [slot]
    with pytest.raises(TransferTimeout):
        c.wait(slot, gen, 0)
    c.on_immediate(pack_immediate(slot, gen), "w")   # late arrival does not revive it
    assert c.state(slot).state == SlotState.FAILED
    assert done == [(slot, gen, SlotState.FAILED)] and c.stats().timed_out == 1


def test_wait_timeout_does_not_fail_slot():
    c, _ = make()
    slot, gen = c.acquire(10)
    with pytest.raises(TransferTimeout):
        c.wait(slot, gen, 0.01)
    assert c.state(slot).state == SlotState.PENDING


def test_wait_wakes_on_arrival_from_another_thread():
    c, _ = make()
    slot, gen = c.acquire(10)
    c.expect(slot, gen, 2)
    t = threading.Timer(0.05, lambda: [c.on_immediate(pack_immediate(slot, gen), "w") for _ in range(2)])
    t.start()
    c.wait(slot, gen, 5)
    t.join()


def test_wait_raises_at_slot_deadline_in_real_time():
    c, _ = make()
    slot, gen = c.acquire(0.05)
    with pytest.raises(TransferTimeout):
        c.wait(slot, gen, 5)


def test_fail_source_fails_only_that_writers_pending_slots():
    c, done = make()
    a, ga = c.acquire(10)
    b, gb = c.acquire(10)
    d, gd = c.acquire(10)
    c.expect(a, ga, 3, source="p1")                # attributed up front
    c.on_immediate(pack_immediate(b, gb), "p1")    # attributed by arrival
    c.on_immediate(pack_immediate(d, gd), "p2")
    assert sorted(c.fail_source("p1", TransferError("gone"))) == sorted([a, b])
    with pytest.raises(PeerLostError):
        c.wait(a, ga, 0)
    assert c.state(d).state == SlotState.PENDING
    assert not c.fail(a, ga, TransferError("again"))   # failure is absorbing, reported once
    assert [x[0] for x in done] == [a, b] or sorted(x[0] for x in done) == sorted([a, b])


def test_capacity_and_release_idempotent():
    c, _ = make(num_slots=2)
    s1, g1 = c.acquire(1)
    c.acquire(1)
    with pytest.raises(TransferError):
        c.acquire(1)
    c.release(s1, g1)
    c.release(s1, g1)   # no-op: stale generation
    c.acquire(1)
    with pytest.raises(TransferError):
        c.acquire(1)


def test_aggregated_arrivals_count_as_many():
    c, done = make()
    slot, gen = c.acquire(10)
    c.expect(slot, gen, 300)
    c.on_immediate(pack_immediate(slot, gen), "w", count=299)
    assert c.state(slot).state == SlotState.PENDING
    c.on_immediate(pack_immediate(slot, gen), "w", count=1)
    assert done == [(slot, gen, SlotState.COMPLETE)]
    c.on_immediate(pack_immediate(slot, gen), "w", count=5)
    assert c.stats().stale_dropped == 5


def test_slots_are_reused_oldest_released_first():
    c, _ = make(num_slots=3)
    slots = [c.acquire(10)[0] for _ in range(3)]
    for s in reversed(slots):
        c.release(s, 0)
    assert [c.acquire(10)[0] for _ in range(3)] == list(reversed(slots))


def test_a_slot_released_after_a_failed_writer_waits_out_its_lease():
    """A late write of the failed use carries generation g; the slot must not reach g again
    (256 reuses) while that write can still land: it is not handed out before ``reuse_after_s``."""
    clock = FakeClock()
    c, _ = make(num_slots=2, clock=clock)
    slot, gen = c.acquire(10)
    c.release(slot, gen, reuse_after_s=90.0)
    other, _ = c.acquire(10)
    assert other != slot
    with pytest.raises(TransferError, match="waiting out"):
        c.acquire(10)
    clock.now += 90.0
    assert c.acquire(10)[0] == slot

