"""A decode request's reservation and its state machine (`ResState`, one transition function
`Reservation.move`; FAILED and DONE are absorbing)::

    RESERVED ──> WAITING_KV ──> DECODING ──> DONE
       │             │
       └─────────────┴──────> FAILED

Reserve creates one RESERVED with a `TransferSlot`; ServeColocated creates one already DECODING
with none (no KV transfer: a colocated request never touches the completion counter). Only a
reservation with a transfer is ever RESERVED or WAITING_KV. `decode.worker.DecodeWorker` drives it
(its docstring has the lifecycle).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from decode.sink import Sink
from engine.ids import BlockId
from engine.sampling import SamplingParams
from kvtransfer import Generation, SlotId


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


@dataclass(frozen=True)
class TransferSlot:
    """The completion-counter slot a request's KV writes are counted in (`kvtransfer.counter`),
    and the generation of this use of it: every write carries both as its immediate."""

    slot: SlotId
    generation: Generation


@dataclass
class Reservation:
    """One request on the decode worker: blocks and a transfer slot held until its KV arrives,
    then the decoding request.

    ``transfer``: the slot its KV writes are counted in; None for a colocated request (no KV
    transfer), which starts DECODING. ``deadline``: monotonic seconds at which a RESERVED
    reservation expires; ``sink`` is set by Decode / ServeColocated."""

    request_id: str
    blocks: list[BlockId]
    transfer: TransferSlot | None
    num_prompt_tokens: int
    deadline: float
    state: ResState = ResState.RESERVED
    writer_stopped: bool = False
    sink: Sink | None = None
    detached: bool = False   # its stream ended early: nobody reads it any more
    first_tokens: list[int] = field(default_factory=list)   # one per choice
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    num_held_blocks: int = 0   # blocks[:num_held_blocks] came from the prefix cache: not written
    reserved_prompt: list[int] | None = None   # the prompt given at Reserve (Decode must repeat it)
    writers: frozenset[str] = frozenset()   # endpoint ids of the ranks named to write its KV (Reserve)

    def __post_init__(self) -> None:
        if (self.transfer is None) != (self.state == ResState.DECODING):
            raise AssertionError(f"reservation {self.request_id}: one with a transfer starts RESERVED, "
                                 "one without (colocated) DECODING")

    def require_transfer(self) -> TransferSlot:
        """``transfer``, for a reservation that has one: every RESERVED or WAITING_KV one, and one
        that failed or decodes after its KV. Raises AssertionError for a colocated request (it has
        no transfer and never touches the counter)."""
        if self.transfer is None:
            raise AssertionError(f"reservation {self.request_id} has no KV transfer (colocated)")
        return self.transfer

    def move(self, new: ResState) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"reservation {self.request_id}: {self.state.name} -> {new.name}")
        self.state = new
