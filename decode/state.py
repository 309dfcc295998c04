"""A decode request's state on the decode worker: the reservation and its state machine, the
load report, where outputs go (`Sink`), and the arrival sink the transfer engine feeds
(`DecodeArrivals`). `decode.worker.DecodeWorker` drives them (its docstring has the lifecycle).
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass
from typing import Protocol

from engine.generator import StepOutput
from engine.ids import BlockId
from engine.sampling import SamplingParams
from kvtransfer import CompletionCounter, KVTransferError, TransferError


class ResState(enum.IntEnum):
    RESERVED = 0
    WAITING_KV = 1
    DECODING = 2
    FAILED = 3
    DONE = 4


_NEXT = {
    ResState.RESERVED: {ResState.WAITING_KV, ResState.FAILED},
    ResState.WAITING_KV: {ResState.DECODING, ResState.FAILED},
    ResState.DECODING: {ResState.DONE},
    ResState.FAILED: set(),
    ResState.DONE: set(),
}


class Sink(Protocol):
    """Where a request's outputs go: `StepOutput` items (the last has ``finish_reason``), or
    one `KVTransferError` when its transfer failed. ``put`` is called from the decode loop and
    RPC threads; it must not block."""

    def put(self, item: StepOutput | KVTransferError) -> None: ...


@dataclass
class Reservation:
    """Blocks and a transfer slot held for one request until its KV arrives, then the request.

    ``deadline``: monotonic seconds at which a RESERVED reservation expires; ``sink`` is set by
    Decode / Generate."""

    request_id: str
    blocks: list[BlockId]
    slot: int
    generation: int
    num_prompt_tokens: int
    deadline: float
    state: ResState = ResState.RESERVED
    writer_stopped: bool = False
    sink: Sink | None = None
    detached: bool = False   # its stream ended early: nobody reads it any more
    first_token: int | list[int] = 0   # n > 1: one per choice
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    num_held: int = 0   # blocks[:num_held] came from the prefix cache: no transfer writes them
    reserved_prompt: list[int] | None = None   # the prompt given at Reserve (Decode must repeat it)

    def move(self, new: ResState) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"reservation {self.request_id}: {self.state.name} -> {new.name}")
        self.state = new


@dataclass(frozen=True)
class DecodeLoad:
    """A decode worker's load: blocks, sequences decoding or queued, reservations not decoding."""

    free_blocks: int
    total_blocks: int
    running: int
    waiting_kv: int
    reserved_blocks: int
    draining: bool


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


class QueueSink:
    """A `Sink` over a ``queue.SimpleQueue`` (tests and blocking readers)."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self.items.put(item)
