"""One prefill request's job: its state machine and how its outcome reaches the caller.

States (one transition function, `PrefillJob.move`; FAILED and DONE are absorbing)::

    QUEUED ──> COMPUTING ──> TRANSFERRING ──> DONE
       │           │              │
       └───────────┴──────────────┴──────> FAILED

A job fails through `PrefillJob.fail` only (the first error wins; an aborted or failed job posts
no more writes). It is *finished* once it is DONE or FAILED **and** every write it posted has
completed: only then are its source blocks free and its done callbacks called, which is what
"abort acknowledged" means to the decode side's block-reuse rule. A coroutine awaits that with
`wait_finished`.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.ids import BlockId
from engine.errors import InvalidRequestError
from engine.kv_cache import blocks_needed
from engine.sampling import SamplingError, SamplingParams, TokenLogprobs
from engine.sequence import token_finish_reason
from kvtransfer import WriteHandle
from worker.errors import PrefillAborted, PrefillError
from worker.tp_rank import DecodePeer


class JobState(enum.IntEnum):
    QUEUED = 0
    COMPUTING = 1
    TRANSFERRING = 2
    DONE = 3
    FAILED = 4


_NEXT = {
    JobState.QUEUED: {JobState.COMPUTING, JobState.FAILED},
    JobState.COMPUTING: {JobState.TRANSFERRING, JobState.FAILED},
    JobState.TRANSFERRING: {JobState.DONE, JobState.FAILED},
    JobState.DONE: set(),
    JobState.FAILED: set(),
}


@dataclass(frozen=True)
class PrefillLoad:
    """A prefill worker's load: blocks, jobs in flight, prompt tokens not yet computed."""

    free_blocks: int
    total_blocks: int
    jobs: int
    queued_prompt_tokens: int
    draining: bool


def check_destination(num_prompt_tokens: int, dst_blocks: list[int], num_held_blocks: int,
                      peer_blocks: int, block_size: int) -> None:
    """Check a job's destination in the decode pool: ``dst_blocks`` are the distinct blocks, inside
    the peer's ``peer_blocks``, of the prompt's blocks after the ``num_held_blocks`` full ones the
    decode worker holds. Raises InvalidRequestError naming what is wrong."""
    need = blocks_needed(num_prompt_tokens, block_size)
    if not 0 <= num_held_blocks <= num_prompt_tokens // block_size:
        raise InvalidRequestError(f"num_held_blocks {num_held_blocks} is more than the prompt's full blocks")
    if len(dst_blocks) != need - num_held_blocks:
        raise InvalidRequestError(f"{len(dst_blocks)} destination blocks for a prompt needing {need} "
                                  f"of which the decode worker holds {num_held_blocks}")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise InvalidRequestError("destination block ids are not distinct")
    if any(not 0 <= b < peer_blocks for b in dst_blocks):
        raise InvalidRequestError(f"destination block ids outside the decode pool [0, {peer_blocks})")


@dataclass(frozen=True)
class PrefillResult:
    """A finished job: per choice (``params.n`` of them) the first token, why it ends the choice
    (``""``: it does not; "stop", "length": `engine.sequence.token_finish_reason`) and its
    logprobs when asked for; the writes the decode side must count, bytes, seconds."""

    first_tokens: list[int]
    finish_reasons: list[str]
    num_writes: int
    bytes_written: int
    compute_seconds: float
    transfer_seconds: float
    first_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    bytes_skipped: int = 0        # KV bytes not written: the decode worker held those blocks
    prefix_hit_tokens: int = 0    # prompt tokens found in this worker's prefix cache


@dataclass(eq=False)
class PrefillJob:
    """One request's prefill + KV transfer. ``deadline``: monotonic seconds by which every write
    must be posted (its lease)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    peer: DecodePeer | None           # None: a warm-up (`PrefillWorker.warm`): computes, writes nothing
    dst_blocks: list[int]
    slot: int
    generation: int
    deadline: float
    num_held_blocks: int = 0          # leading prompt blocks the decode worker holds: not written
    peer_id: str = ""                 # the decode worker's id
    tp_key: int | None = None         # tensor parallel: its number in the other ranks' reports
    warm: bool = False                # a prefix-cache warm-up: no first token, no writes
    state: JobState = JobState.QUEUED
    queued_at: float = field(default_factory=time.monotonic)   # monotonic seconds (scheduling order)
    error: Exception | None = None
    block_table: list[BlockId] = field(default_factory=list)
    num_computed: int = 0
    first_tokens: list[int] = field(default_factory=list)       # one per choice, once sampled
    finish_reasons: list[str] = field(default_factory=list)     # one per choice ("": runs on)
    first_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    matcher: object | None = None     # `engine.grammar.Matcher` when params.grammar is set
    block_hashes: list = field(default_factory=list)   # prefix caching: the prompt's full blocks
    num_registered: int = 0           # leading blocks registered in the prefix cache
    num_writes: int = 0
    bytes_posted: int = 0
    bytes_skipped: int = 0
    prefix_hit_tokens: int = 0
    handles: list[WriteHandle] = field(default_factory=list)
    compute_seconds: float = 0.0
    transfer_seconds: float = 0.0
    finished: threading.Event = field(default_factory=threading.Event)
    _callbacks: list[Callable[["PrefillJob"], None]] = field(default_factory=list)
    _cb_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens it computes: its prompt (`engine.runner.RunnerSeq`)."""
        return self.prompt_token_ids

    def move(self, new: JobState) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"prefill job {self.request_id}: {self.state.name} -> {new.name}")
        self.state = new

    def fail(self, error: Exception) -> None:
        """Record why the job fails (the first error wins); it posts no more writes."""
        if self.error is None:
            self.error = error

    @property
    def stopped(self) -> bool:
        """True once the job must post no more writes."""
        return self.error is not None

    @property
    def aborted(self) -> bool:
        return isinstance(self.error, PrefillAborted)

    def result(self) -> PrefillResult:
        """The outcome of a finished job; raises its error when it failed."""
        if self.error is not None:
            raise self.error
        return PrefillResult(self.first_tokens, self.finish_reasons, self.num_writes, self.bytes_posted,
                             self.compute_seconds, self.transfer_seconds, self.first_logprobs,
                             self.prompt_logprobs, self.bytes_skipped, self.prefix_hit_tokens)

    def set_first_tokens(self, drawn: list, rows: list, max_position: int) -> None:
        """Record every choice's first token from its sampling row's draw (``drawn[i]``:
        ``(token or SamplingError, TokenLogprobs or None)`` of ``rows[i]``), and whether it ends
        the choice (`engine.sequence.token_finish_reason`; ``max_position``: the model's
        context). A choice that could not be sampled fails the job."""
        bad = next((t for t, _ in drawn if isinstance(t, SamplingError)), None)
        if bad is not None:
            self.fail(PrefillError(f"sampling the first token failed: {bad}"))
            return
        self.first_tokens = [int(t) for t, _ in drawn]
        self.first_logprobs = [lp for _, lp in drawn if lp is not None]
        self.finish_reasons = []
        for token, row in zip(self.first_tokens, rows):
            reason = token_finish_reason(token, row.stop_token_ids, 1, row.params.max_tokens,
                                         len(self.prompt_token_ids) + 1, max_position)
            self.finish_reasons.append(reason.value if reason is not None else "")

    def add_done_callback(self, callback: Callable[["PrefillJob"], None]) -> None:
        """Call ``callback(job)`` once the job finished (at once if it has); from the thread
        that finishes it. Callbacks must not block."""
        with self._cb_lock:
            if not self.finished.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def set_finished(self) -> None:
        """Mark finished and run the callbacks (called once, by the worker)."""
        with self._cb_lock:
            self.finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


async def wait_finished(job, timeout_s: float | None) -> bool:
    """Wait (without blocking the loop) until ``job`` (anything with ``add_done_callback(fn)``
    calling ``fn(job)`` once finished) finishes; False if ``timeout_s`` (None: no limit) passed
    first."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def _finished(_job) -> None:
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    job.add_done_callback(_finished)
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
