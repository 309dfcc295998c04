"""The arrival sink the transfer engine feeds on a decode worker: `DecodeArrivals`."""

from __future__ import annotations

import threading

from kvtransfer import CompletionCounter, TransferError


class DecodeArrivals:
    """The transfer engine's arrival sink for a decode worker: immediates go to a
    `CompletionCounter` of ``num_slots`` transfer slots; a slot that completes or fails calls the
    ``on_done`` callbacks (the decode loop wakes up). A writer with no live connection left to
    any of the worker's engines (its own and its TP ranks', counted from ``on_peer_connected`` /
    ``on_peer_gone``), lost or closed, is in ``lost`` and reaches the ``on_lost`` callbacks (the
    decode worker frees quarantined blocks that writer was the last that could write into).
    Callbacks run on engine threads and must not block."""

    def __init__(self, num_slots: int):
        self.counter = CompletionCounter(num_slots, on_done=self._done)
        self.on_done: list = []
        self.on_lost: list = []
        self.lost: set[str] = set()   # writers whose every connection ended, not connected since
        self._live: dict[str, int] = {}   # writer -> engines it has a live connection to
        self._lock = threading.Lock()

    def _done(self, slot, generation, state) -> None:
        for callback in list(self.on_done):
            callback()

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        self.counter.on_immediate(imm, source, count)

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        self.counter.on_peer_lost(source, error)   # its pending transfers fail at once

    def on_peer_connected(self, source: str) -> None:
        with self._lock:
            self._live[source] = self._live.get(source, 0) + 1
            self.lost.discard(source)

    def on_peer_gone(self, source: str) -> None:
        with self._lock:
            left = self._live.get(source, 0) - 1
            if left > 0:
                self._live[source] = left
                return
            self._live.pop(source, None)
            self.lost.add(source)
        for callback in list(self.on_lost):
            callback(source)
