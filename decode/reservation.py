"""A decode request's reservation and its state machine (`ResState`, one transition function
`Reservation.move`; FAILED and DONE are absorbing)::

    RESERVED ──> WAITING_KV ──> DECODING ──> DONE
       │             │
       └─────────────┴──────> FAILED

ServeColocated creates one already DECODING. `decode.worker.DecodeWorker` drives it (its
docstring has the lifecycle).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from decode.sink import Sink
from engine.ids import BlockId
from engine.sampling import SamplingParams


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


@dataclass
class Reservation:
    """Blocks and a transfer slot held for one request until its KV arrives, then the request.

    ``deadline``: monotonic seconds at which a RESERVED reservation expires; ``sink`` is set by
    Decode / ServeColocated."""

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
    first_tokens: list[int] = field(default_factory=list)   # one per choice
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    num_held: int = 0   # blocks[:num_held] came from the prefix cache: no transfer writes them
    reserved_prompt: list[int] | None = None   # the prompt given at Reserve (Decode must repeat it)

    def move(self, new: ResState) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"reservation {self.request_id}: {self.state.name} -> {new.name}")
        self.state = new
