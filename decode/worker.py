"""The decode worker's core: reservations, KV arrival, the continuous-batching decode loop.

Lifecycle of a request (ARCHITECTURE.md, "One request, end to end"):

    Reserve   blocks for the prompt + a transfer slot (slot, generation)    -> RESERVED
              (no free blocks: CapacityError; the router tries another worker)
    Decode    expect(num_writes); wait until the slot's immediates reach it -> DECODING
              the request joins the running batch with its first token; the loop thread streams
              every StepOutput to the request's queue until it finishes (blocks freed by the
              generator)
    failure   transfer deadline, writer lost, abort before the KV completed -> the slot is
              released (its generation bumps, late immediates are dropped as stale) and the
              blocks are freed only when no writer can still write into them:
              - at once if the writer's connection is gone (PeerLostError) or the caller says the
                writer stopped (Abort with writer_stopped);
              - otherwise after ``quarantine_s`` (longer than any writer's lease).
    expiry    a reservation whose Decode never comes is failed at ``transfer_timeout_s``.

Threads: ``decode-loop`` owns the generator (one lock guards the generator, the reservations and
the quarantine); gRPC handler threads block in `start_decode` waiting for KV, then read their
request's queue.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.errors import CapacityError, InvalidRequestError
from engine.generator import Generator, StepOutput
from engine.ids import BlockId
from engine.kv_cache import blocks_needed
from engine.sampling import SamplingParams
from engine.sequence import FinishReason
from kvtransfer import CompletionCounter, KVTransferError, PeerLostError, TransferError, TransferTimeout
from worker.gate import StepGate
from worker.runtime import WorkerResources

log = logging.getLogger(__name__)


class DrainingError(Exception):
    """The worker is draining and accepts no new requests."""


class UnknownRequestError(KeyError):
    """No reservation with that request id."""


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
    """Blocks and a transfer slot held for one request until its KV arrives."""

    request_id: str
    blocks: list[BlockId]
    slot: int
    generation: int
    deadline: float
    state: ResState = ResState.RESERVED
    writer_stopped: bool = False
    outputs: "queue.SimpleQueue[StepOutput]" = field(default_factory=queue.SimpleQueue)

    def move(self, new: ResState) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"reservation {self.request_id}: {self.state.name} -> {new.name}")
        self.state = new


class DecodeArrivals:
    """The transfer engine's arrival sink for a decode worker: immediates go to the
    `CompletionCounter`; a writer's lost connection also reaches ``on_lost`` callbacks (the decode
    worker frees quarantined blocks that writer was the last to touch)."""

    def __init__(self, counter: CompletionCounter):
        self.counter = counter
        self.on_lost: list = []
        self.lost: set[str] = set()   # writers whose connection ended and that have not written since

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        if source in self.lost:   # it connected again
            self.lost.discard(source)
        self.counter.on_immediate(imm, source, count)

    def on_peer_lost(self, source: str, error: TransferError) -> None:
        self.lost.add(source)
        self.counter.on_peer_lost(source, error)
        for callback in list(self.on_lost):
            callback(source)


class DecodeWorker:
    """Reservations + KV arrival counting + the decode loop over one KV pool.

    Args:
        res: the worker's resources; ``res.transfer`` must deliver arrivals to ``counter``.
        counter: the `CompletionCounter` the transfer engine feeds.
    """

    def __init__(self, res: WorkerResources, arrivals: DecodeArrivals):
        c = res.config
        self.res = res
        self.arrivals = arrivals
        self.counter = arrivals.counter
        arrivals.on_lost.append(self._writer_lost)
        self.gen = Generator(res.loaded.model, res.pool, None,
                             SchedulerConfig(max_num_seqs=c.max_num_seqs,
                                             max_num_batched_tokens=c.max_num_batched_tokens))
        self._lock = StepGate()   # the loop holds it per step and lets RPC threads in between
        self._reservations: dict[str, Reservation] = {}
        # (expiry, blocks, writers that may still write into them)
        self._quarantine: list[tuple[float, list[BlockId], set[str]]] = []
        self._draining = False
        self._stop = threading.Event()
        self.metrics = {"transfers_completed": 0, "transfers_failed": 0, "reservations_expired": 0,
                        "blocks_quarantined": 0, "requests_finished": 0, "requests_aborted": 0}
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._thread.start()

    # -- RPC-facing operations ----------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> Reservation:
        """Allocate blocks for the prompt and a transfer slot.

        Raises:
            DrainingError, CapacityError (pool or slots full), InvalidRequestError, ValueError
            (duplicate id).
        """
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise InvalidRequestError("num_prompt_tokens and max_tokens must be >= 1")
        need = blocks_needed(num_prompt_tokens, self.res.pool.block_size)
        with self._lock:
            if self._draining:
                raise DrainingError("decode worker is draining")
            if request_id in self._reservations:
                raise ValueError(f"request {request_id!r} already reserved")
            blocks = self.res.pool.allocator.allocate(need)  # CapacityError: nothing taken
            try:
                slot, generation = self.counter.acquire(self.res.config.transfer_timeout_s)
            except TransferError as exc:
                self.res.pool.allocator.free(blocks)
                raise CapacityError(str(exc)) from exc
            r = Reservation(request_id, blocks, slot, generation,
                            time.monotonic() + self.res.config.transfer_timeout_s)
            self._reservations[request_id] = r
            return r

    def start_decode(self, request_id: str, first_token: int, num_writes: int,
                     prompt_token_ids: list[int], params: SamplingParams) -> Reservation:
        """Wait for the request's KV, then join it to the running batch.

        Returns the reservation; its ``outputs`` queue receives every `StepOutput` (the last one
        has ``finish_reason``). Raises UnknownRequestError, InvalidRequestError, or the transfer's
        `KVTransferError` (TransferTimeout, PeerLostError, ...) after releasing the slot.
        """
        with self._lock:
            r = self._reservations.get(request_id)
            if r is None or r.state != ResState.RESERVED:
                raise UnknownRequestError(request_id)
            if len(prompt_token_ids) > len(r.blocks) * self.res.pool.block_size:
                self._fail(r, InvalidRequestError("prompt longer than the reservation"))
                raise InvalidRequestError("prompt longer than the reservation")
            r.move(ResState.WAITING_KV)
        try:
            self.counter.expect(r.slot, r.generation, num_writes)
            self.counter.wait(r.slot, r.generation, timeout_s=max(0.0, r.deadline - time.monotonic()) + 1.0)
            self.res.transfer.flush_arrivals()   # GPUDirect: the bytes are visible to kernels from here
        except KVTransferError as exc:
            with self._lock:
                self._fail(r, exc)
            raise
        with self._lock:
            if r.state != ResState.WAITING_KV:  # aborted while waiting
                raise TransferError(f"request {request_id} was aborted")
            self.counter.release(r.slot, r.generation)
            self.metrics["transfers_completed"] += 1
            r.move(ResState.DECODING)
            done = self.gen.add_prefilled(request_id, prompt_token_ids, first_token, r.blocks, params)
            if done is not None:
                self._finish(r, done)
            self._lock.notify_all()
        return r

    def generate_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation:
        """Colocated serving: prefill and decode here, no transfer. Outputs arrive on the returned
        reservation's queue as for `start_decode` (the first output carries the first token).

        Raises DrainingError, InvalidRequestError / ContextLengthError, CapacityError, ValueError.
        """
        with self._lock:
            if self._draining:
                raise DrainingError("decode worker is draining")
            if request_id in self._reservations:
                raise ValueError(f"request {request_id!r} already in flight")
            self.gen.add_request(request_id, prompt_token_ids, params)
            r = Reservation(request_id, [], -1, -1, float("inf"), state=ResState.DECODING)
            self._reservations[request_id] = r
            self._lock.notify_all()
            return r

    def abort(self, request_id: str, writer_stopped: bool = False) -> bool:
        """Abort a reserved, transferring or decoding request; False if unknown."""
        with self._lock:
            r = self._reservations.get(request_id)
            if r is None:
                return False
            r.writer_stopped = r.writer_stopped or writer_stopped
            if r.state == ResState.DECODING:
                out = self.gen.abort(request_id)
                if out is not None:
                    self._finish(r, out)
            elif r.state in (ResState.RESERVED, ResState.WAITING_KV):
                self.counter.fail(r.slot, r.generation, TransferError("aborted"))
                self._fail(r, TransferError("aborted"))
            self.metrics["requests_aborted"] += 1
            return True

    def load(self):
        """(free_blocks, total_blocks, running, waiting_kv, reserved_blocks, draining)."""
        with self._lock:
            reserved = [r for r in self._reservations.values() if r.state in (ResState.RESERVED, ResState.WAITING_KV)]
            return (self.res.pool.allocator.num_free, self.res.pool.num_blocks,
                    len(self.gen.running) + len(self.gen.waiting), len(reserved),
                    sum(len(r.blocks) for r in reserved), self._draining)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._reservations)

    def drain(self, timeout_s: float) -> None:
        """Refuse new reservations; wait up to ``timeout_s`` for in-flight requests to finish."""
        end = time.monotonic() + timeout_s
        with self._lock:
            self._draining = True
            while self._reservations and time.monotonic() < end:
                self._lock.wait(0.2)

    def close(self) -> None:
        """Stop and join the decode loop; abort what is left."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=30)
        with self._lock:
            for rid in list(self._reservations):
                r = self._reservations[rid]
                if r.state == ResState.DECODING:
                    out = self.gen.abort(rid)
                    if out is not None:
                        self._finish(r, out)

    # -- internals (called with the lock held) -------------------------------------------------
    def _fail(self, r: Reservation, error: Exception) -> None:
        if r.state in (ResState.FAILED, ResState.DONE):
            return
        r.move(ResState.FAILED)
        writers = set(self.counter.writers(r.slot, r.generation))
        self.counter.release(r.slot, r.generation)
        self.metrics["transfers_failed"] += 1
        # Every writer that touched the blocks may already have lost its connection (a killed
        # prefill worker is seen by the data plane before the router aborts): nothing can land.
        all_lost = bool(writers) and writers <= self.arrivals.lost
        if r.writer_stopped or isinstance(error, PeerLostError) or all_lost:
            self.res.pool.allocator.free(r.blocks)
        else:
            self._quarantine.append((time.monotonic() + self.res.config.quarantine_s, r.blocks, writers))
            self.metrics["blocks_quarantined"] += len(r.blocks)
        r.outputs.put(StepOutput(r.request_id, [], "", FinishReason.ABORT, 0, 0))
        del self._reservations[r.request_id]
        self._lock.notify_all()

    def _finish(self, r: Reservation, out: StepOutput) -> None:
        r.outputs.put(out)
        if out.finished and r.state == ResState.DECODING:
            r.move(ResState.DONE)
            del self._reservations[r.request_id]
            self.metrics["requests_finished"] += 1
            self._lock.notify_all()

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for r in list(self._reservations.values()):
            if r.state == ResState.RESERVED and now >= r.deadline:
                self.metrics["reservations_expired"] += 1
                self._fail(r, TransferTimeout(f"reservation {r.request_id} expired"))
        keep = []
        for until, blocks, writers in self._quarantine:
            if now >= until:
                self.res.pool.allocator.free(blocks)
            else:
                keep.append((until, blocks, writers))
        self._quarantine = keep

    def _writer_lost(self, source: str) -> None:
        """A writer's connection is gone: it can no longer write into the blocks it touched."""
        with self._lock:
            keep = []
            for until, blocks, writers in self._quarantine:
                if source in writers:
                    writers.discard(source)
                    if not writers:
                        self.res.pool.allocator.free(blocks)
                        continue
                keep.append((until, blocks, writers))
            self._quarantine = keep

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._housekeeping()
                if not self.gen.has_unfinished():
                    self._lock.wait(0.25)
                    continue
                try:
                    outputs = self.gen.step()
                except Exception:  # a bug in a step must not kill the worker silently
                    log.exception("decode step failed; aborting the running batch")
                    outputs = [o for rid in [s.request_id for s in self.gen.running + list(self.gen.waiting)]
                               if (o := self.gen.abort(rid)) is not None]
                for out in outputs:
                    r = self._reservations.get(out.request_id)
                    if r is not None:
                        self._finish(r, out)
            self._lock.yield_to_waiters()   # RPCs (Abort, load, Stats) go before the next step
