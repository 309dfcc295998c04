"""The arrival sink the transfer engine feeds on a decode worker: `DecodeArrivals`."""

from __future__ import annotations

from kvtransfer import CompletionCounter, TransferError


class DecodeArrivals:
    """The transfer engine's arrival sink for a decode worker: immediates go to a
    `CompletionCounter` of ``num_slots`` transfer slots; a slot that completes or fails calls the
    ``on_done`` callbacks (the decode loop wakes up), and a writer's lost connection also reaches
    the ``on_lost`` callbacks (the decode worker frees quarantined blocks that writer was the last
    to touch). Callbacks run on engine threads and must not block."""

    def __init__(self, num_slots: int):
        self.counter = CompletionCounter(num_slots, on_done=self._done)
        self.on_done: list = []
        self.on_lost: list = []
        self.lost: set[str] = set()   # writers whose connection ended and that have not written since

    def _done(self, slot, generation, state) -> None:
        for callback in list(self.on_done):
            callback()

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        if source in self.lost:   # it connected again
            self.lost.discard(source)
        self.counter.on_immediate(imm, source, count)

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        self.lost.add(source)
        self.counter.on_peer_lost(source, error)
        for callback in list(self.on_lost):
            callback(source)
