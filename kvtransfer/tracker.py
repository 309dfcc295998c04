"""Local completions of posted write batches, and the engine's counters."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, fields

from kvtransfer.base import EngineStats, WriteCompletion, WriteHandle, WriteStatus
from kvtransfer.errors import KVTransferError, TransferError, TransferTimeout


@dataclass(slots=True)
class _Pending:
    peer: str
    parts: int
    num_writes: int
    nbytes: int
    error: KVTransferError | None = None


class CompletionTracker:
    """Handles of posted batches. A batch is split into ``parts`` (one per stream or queue); it
    completes when every part reported, FAILED if any part reported an error."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._done: dict[int, WriteCompletion] = {}

    def new(self, peer: str, parts: int, num_writes: int, nbytes: int) -> WriteHandle:
        with self._cond:
            handle = WriteHandle(next(self._ids))
            self._pending[handle] = _Pending(peer, parts, num_writes, nbytes)
            if parts == 0:
                self._finish(handle)
            return handle

    def part_done(self, handle: int, error: KVTransferError | None = None) -> None:
        self.parts_done([(handle, error)])

    def parts_done(self, done: list[tuple[int, KVTransferError | None]]) -> None:
        """Report several parts at once (one lock round and one wake-up for a run of ACKs)."""
        with self._cond:
            for handle, error in done:
                p = self._pending.get(handle)
                if p is None:
                    continue
                p.parts -= 1
                if error is not None and p.error is None:
                    p.error = error
                if p.parts <= 0:
                    self._finish(handle, notify=False)
            self._cond.notify_all()

    def fail(self, handle: int, error: KVTransferError) -> None:
        with self._cond:
            p = self._pending.get(handle)
            if p is not None:
                p.error = p.error or error
                self._finish(handle)

    def fail_peer(self, peer: str, error: KVTransferError) -> None:
        with self._cond:
            for handle in [h for h, p in self._pending.items() if p.peer == peer]:
                self.fail(handle, error)

    def fail_all(self, error: KVTransferError) -> None:
        with self._cond:
            for handle in list(self._pending):
                self.fail(handle, error)

    def poll(self) -> list[WriteCompletion]:
        with self._cond:
            done = list(self._done.values())
            self._done.clear()
            return done

    def wait(self, handle: int, timeout_s: float | None) -> WriteCompletion:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while handle not in self._done:
                if handle not in self._pending:
                    raise TransferError(f"unknown or already consumed write handle {handle}")
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(f"write handle {handle} not complete after {timeout_s}s")
                self._cond.wait(left)
            completion = self._done.pop(handle)
        if completion.error is not None:
            raise completion.error
        return completion

    def _finish(self, handle: int, notify: bool = True) -> None:
        p = self._pending.pop(handle)
        status = WriteStatus.FAILED if p.error else WriteStatus.OK
        self._done[handle] = WriteCompletion(WriteHandle(handle), status, p.num_writes, p.nbytes, p.error)
        if notify:
            self._cond.notify_all()


class EngineCounters:
    """Thread-safe increments of :class:`EngineStats` fields (callers batch hot-path increments)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(STAT_FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> EngineStats:
        with self._lock:
            return EngineStats(**self._values)


STAT_FIELDS = tuple(f.name for f in fields(EngineStats))
