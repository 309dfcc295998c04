"""Receiver-side completion counting: a transfer slot is done when its immediates reach the count.

Lifecycle of one slot (decode worker side)::

    acquire(deadline_s) -> (slot, generation)      # Reserve: hand both to the router
        on_immediate(imm, source)  x N             # engine threads; any order, any time
        expect(slot, generation, n)                # Decode(num_writes): may come before or after
        wait(slot, generation) / state(slot)       # returns once received == n
    release(slot, generation, reuse_after_s)       # generation bumps; late writes become stale

States (:class:`SlotState`): ``FREE -> PENDING -> COMPLETE | FAILED``, back to ``FREE`` only via
``release``. ``FAILED`` is absorbing until release: the deadline passing (``TransferTimeout``), the
peer that was writing dying (``fail_source`` -> ``PeerLostError``), more immediates than expected,
or an explicit ``fail``. A slot completes or fails exactly once; ``on_done`` is called once per
acquisition with the final state.

Slot reuse: free slots are handed out oldest-released first, and a slot released after a failure
whose writer may still be writing (``reuse_after_s`` > 0, the writer's lease) is not handed out
again before that time. The 8-bit generation therefore cannot wrap around to a value a late
write of an earlier use still carries while that write can arrive.

Ownership: releasing a slot does not make its KV blocks reusable. A block may be reused only when
no peer can still write into it: the slot COMPLETED, or the writer confirmed it stopped, or its
connection is torn down (the caller's rule, see the package docstring). Immediates for a released
generation are dropped and counted in ``stats().stale_dropped``.

Thread safety: every method may be called from any thread. Waiting blocks on a condition variable.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from kvtransfer.errors import KVTransferError, PeerLostError, TransferError, TransferTimeout
from kvtransfer.immediate import (MAX_SLOTS, Generation, SlotId, next_generation,
                                  unpack_immediate)


class SlotState(IntEnum):
    FREE = 0
    PENDING = 1
    COMPLETE = 2
    FAILED = 3


_ALLOWED = {
    SlotState.FREE: {SlotState.PENDING},
    SlotState.PENDING: {SlotState.COMPLETE, SlotState.FAILED, SlotState.FREE},
    SlotState.COMPLETE: {SlotState.FREE},
    SlotState.FAILED: {SlotState.FREE},
}


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """A snapshot of one slot."""

    slot: SlotId
    generation: Generation
    state: SlotState
    expected: int | None
    received: int
    error: KVTransferError | None


@dataclass(frozen=True, slots=True)
class CounterStats:
    """Monotonic counters since construction."""

    completed: int
    failed: int
    timed_out: int
    stale_dropped: int
    invalid_dropped: int


@dataclass(slots=True)
class _Slot:
    generation: int = 0
    state: SlotState = SlotState.FREE
    expected: int | None = None
    received: int = 0
    deadline: float = float("inf")
    sources: set[str] = field(default_factory=set)
    error: KVTransferError | None = None


DoneCallback = Callable[[SlotId, Generation, SlotState], None]


class CompletionCounter:
    """Counts immediates per transfer slot; implements the engines' ``ArrivalHandler`` protocol.

    Args:
        num_slots: size of the transfer table, ``1 <= num_slots <= 2**24``.
        on_done: optional callback ``(slot, generation, final_state)``, called exactly once per
            acquisition when the slot completes or fails, from whichever thread caused it, never
            while holding the counter's lock.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, num_slots: int, on_done: DoneCallback | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS}], got {num_slots}")
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free: deque[int] = deque(range(num_slots))      # oldest released first
        self._cooling: list[tuple[float, int]] = []           # heap of (reusable at, slot)
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._on_done = on_done
        self._clock = clock
        self._completed = self._failed = self._timed_out = 0
        self._stale = self._invalid = 0

    # -- reservation -------------------------------------------------------------------------
    def acquire(self, deadline_s: float) -> tuple[SlotId, Generation]:
        """Reserve a free slot whose transfer must complete within ``deadline_s`` seconds.

        Raises ``TransferError`` when every slot is in use (the caller reports no capacity).
        """
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        with self._cond:
            now = self._clock()
            while self._cooling and self._cooling[0][0] <= now:
                self._free.append(heapq.heappop(self._cooling)[1])
            if not self._free:
                raise TransferError(f"all {len(self._slots)} transfer slots are in use "
                                    f"({len(self._cooling)} waiting out a failed writer's lease)")
            index = self._free.popleft()
            slot = self._slots[index]
            self._transition(slot, SlotState.PENDING)
            self._pending.add(index)
            slot.expected, slot.received, slot.error = None, 0, None
            slot.sources = set()
            slot.deadline = self._clock() + deadline_s
            return SlotId(index), Generation(slot.generation)

    def release(self, slot: int, generation: int, reuse_after_s: float = 0.0) -> None:
        """Return ``slot`` to the free list and bump its generation. Idempotent for a stale
        ``generation`` (a no-op). Any later immediate for ``generation`` is dropped as stale.
        ``reuse_after_s`` (seconds): keep the slot out of `acquire` that long (a writer that may
        still write, see the module docstring)."""
        with self._cond:
            s = self._get(slot)
            if s.generation != generation or s.state == SlotState.FREE:
                return
            self._transition(s, SlotState.FREE)
            self._pending.discard(slot)
            s.generation = next_generation(s.generation)
            s.sources = set()
            if reuse_after_s > 0:
                heapq.heappush(self._cooling, (self._clock() + reuse_after_s, slot))
            else:
                self._free.append(slot)
            self._cond.notify_all()

    def extend(self, slot: int, generation: int, deadline_s: float) -> bool:
        """Move a pending slot's deadline to ``deadline_s`` seconds from now; False if the slot
        is not pending for ``generation``."""
        with self._cond:
            s = self._get(slot)
            if s.generation != generation or s.state != SlotState.PENDING:
                return False
            s.deadline = self._clock() + deadline_s
            return True

    # -- counting ----------------------------------------------------------------------------
    def expect(self, slot: int, generation: int, num_writes: int, source: str | None = None) -> None:
        """Set the number of writes of the slot's transfer (may follow arrivals).

        ``source`` (the writer's endpoint id) attributes the slot to that peer so
        :meth:`fail_source` fails it even before any of its writes arrived.
        Raises ``TransferError`` if the generation is stale or a different count was set before.
        """
        if num_writes < 0:
            raise ValueError(f"num_writes must be >= 0, got {num_writes}")
        done = []
        with self._cond:
            s = self._get(slot)
            if s.generation != generation or s.state == SlotState.FREE:
                raise TransferError(f"slot {slot} generation {generation} is not reserved")
            if s.expected is not None and s.expected != num_writes:
                raise TransferError(f"slot {slot}: expected count {s.expected} already set, got {num_writes}")
            s.expected = num_writes
            if source is not None:
                s.sources.add(source)
            if s.state == SlotState.PENDING:
                done = self._check(slot, s)
        self._notify(done)

    def on_immediate(self, imm: int, source: str = "", count: int = 1) -> None:
        """Count ``count`` arrived writes carrying ``imm`` (engine threads call this; never raises
        on bad input; stale or invalid immediates are dropped and counted ``count`` times)."""
        try:
            decoded = unpack_immediate(imm)
        except ValueError:
            decoded = None
        done = []
        with self._cond:
            if decoded is None or decoded.slot >= len(self._slots):
                self._invalid += count
                return
            s = self._slots[decoded.slot]
            if s.generation != decoded.generation or s.state != SlotState.PENDING:
                self._stale += count
                return
            s.received += count
            if source:
                s.sources.add(source)
            done = self._check(decoded.slot, s)
        self._notify(done)

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        """``ArrivalHandler`` hook: fail the pending slots that ``source`` was writing."""
        self.fail_source(source, error)

    def on_peer_connected(self, source: str) -> None:
        """``ArrivalHandler`` hook: nothing to do."""

    def on_peer_gone(self, source: str) -> None:
        """``ArrivalHandler`` hook: fails nothing (a lost connection already failed its slots in
        ``on_peer_lost``; a closed one applied every write it posted); a slot still pending
        waits for its other writers or its deadline."""

    # -- failure and waiting -----------------------------------------------------------------
    def fail(self, slot: int, generation: int, error: KVTransferError) -> bool:
        """Fail a pending slot; False if it was not pending (already done, stale, free)."""
        with self._cond:
            s = self._get(slot)
            if s.generation != generation or s.state != SlotState.PENDING:
                return False
            done = [self._finish(slot, s, SlotState.FAILED, error)]
        self._notify(done)
        return True

    def fail_source(self, source: str, error: TransferError) -> list[SlotId]:
        """Fail every pending slot attributed to ``source``; returns the failed slots."""
        done = []
        with self._cond:
            for index in list(self._pending):
                s = self._slots[index]
                if s.state == SlotState.PENDING and source in s.sources:
                    err = PeerLostError(f"slot {index}: writer {source} lost: {error}")
                    done.append(self._finish(index, s, SlotState.FAILED, err))
        self._notify(done)
        return [d[0] for d in done]

    def expire_overdue(self) -> list[SlotId]:
        """Fail (``TransferTimeout``) every pending slot past its deadline; returns them."""
        done = []
        with self._cond:
            now = self._clock()
            for index in list(self._pending):
                s = self._slots[index]
                if s.state == SlotState.PENDING and now >= s.deadline:
                    done.append(self._expire(index, s))
        self._notify(done)
        return [d[0] for d in done]

    def wait(self, slot: int, generation: int, timeout_s: float | None = None) -> None:
        """Block until the slot completes.

        Returns when COMPLETE. Raises the slot's error when FAILED (``TransferTimeout`` if its
        deadline passed while waiting, ``PeerLostError``, ...); ``TransferTimeout`` without
        failing the slot if ``timeout_s`` passes first; ``TransferError`` if the generation is stale.
        """
        end = float("inf") if timeout_s is None else self._clock() + timeout_s
        done = []
        with self._cond:
            while True:
                s = self._get(slot)
                if s.generation != generation or s.state == SlotState.FREE:
                    raise TransferError(f"slot {slot} generation {generation} was released")
                if s.state == SlotState.COMPLETE:
                    return
                if s.state == SlotState.FAILED:
                    assert s.error is not None
                    raise s.error
                now = self._clock()
                if now >= s.deadline:
                    done.append(self._expire(slot, s))
                    break
                if now >= end:
                    raise TransferTimeout(f"slot {slot}: wait timed out after {timeout_s}s "
                                          f"({s.received}/{s.expected} writes)")
                self._cond.wait(min(s.deadline, end) - now)
        self._notify(done)
        raise done[0][3]

    def writers(self, slot: int, generation: int) -> frozenset[str]:
        """Endpoint ids of the writers seen for (``slot``, ``generation``) (from arrivals and
        ``expect(source=...)``); empty once the slot was acquired again."""
        with self._cond:
            s = self._get(slot)
            return frozenset(s.sources) if s.generation == generation else frozenset()

    def state(self, slot: int) -> SlotStatus:
        """A snapshot of ``slot``."""
        with self._cond:
            s = self._get(slot)
            return SlotStatus(SlotId(slot), Generation(s.generation), s.state, s.expected, s.received, s.error)

    def stats(self) -> CounterStats:
        with self._cond:
            return CounterStats(self._completed, self._failed, self._timed_out, self._stale, self._invalid)

    # -- internals (lock held) -----------------------------------------------------------------
    def _get(self, slot: int) -> _Slot:
        if not 0 <= slot < len(self._slots):
            raise ValueError(f"slot {slot} outside [0, {len(self._slots)})")
        return self._slots[slot]

    @staticmethod
    def _transition(s: _Slot, new: SlotState) -> None:
        if new not in _ALLOWED[s.state]:
            raise AssertionError(f"slot transition {s.state.name} -> {new.name}")
        s.state = new

    def _check(self, index: int, s: _Slot) -> list:
        if s.expected is None or s.received < s.expected:
            return []
        if s.received == s.expected:
            return [self._finish(index, s, SlotState.COMPLETE, None)]
        err = TransferError(f"slot {index}: {s.received} writes arrived, {s.expected} expected")
        return [self._finish(index, s, SlotState.FAILED, err)]

    def _expire(self, index: int, s: _Slot) -> tuple:
        self._timed_out += 1
        err = TransferTimeout(f"slot {index}: transfer deadline passed ({s.received}/{s.expected} writes)")
        return self._finish(index, s, SlotState.FAILED, err)

    def _finish(self, index: int, s: _Slot, state: SlotState, error: KVTransferError | None) -> tuple:
        self._transition(s, state)
        self._pending.discard(index)
        s.error = error
        if state == SlotState.COMPLETE:
            self._completed += 1
        else:
            self._failed += 1
        self._cond.notify_all()
        return (SlotId(index), Generation(s.generation), state, error)

    def _notify(self, done: list) -> None:
        if self._on_done is not None:
            for slot, generation, state, _ in done:
                self._on_done(slot, generation, state)
