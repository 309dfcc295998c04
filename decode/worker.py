"""The decode worker's core: reservations, KV arrival, the continuous-batching decode loop.

Lifecycle of a request (ARCHITECTURE.md, "One request, end to end"):

    Reserve   blocks for the prompt + a `TransferSlot` (slot, generation)   -> RESERVED
              (no free blocks or slots: CapacityError; the router tries another worker). The
              reservation lives ``transfer_timeout_s`` (its lease, told to the router) waiting
              for its Decode call. With prefix caching and the prompt given, the blocks of its
              longest cached prefix are taken first (held: a reference each, so no eviction
              can take them) and only the rest is to be written (delta transfer).
    Decode    arguments checked (nothing changes when they are wrong), then
              expect(num_writes)                                             -> WAITING_KV
              The call returns at once: the ``decode-loop`` thread polls the waiting transfers
              between steps (no thread waits for KV). Once the slot's immediates reach the count
              the request joins the running batch with its first token       -> DECODING
              and every `StepOutput` goes to the request's sink until it finishes (blocks freed
              by the generator).
    failure   transfer deadline, writer lost, abort before the KV completed -> FAILED: the sink
              gets the typed error; the slot is released (its generation bumps, late immediates
              are dropped as stale) and the blocks are freed only when no writer can still
              write into them:
              - at once if no writer that could write into them has a connection left
                (`DecodeArrivals.lost`: every connection of each ended, lost or closed), the
                transfer completed, or the caller says the writer stopped (Abort with
                writer_stopped);
              - otherwise after ``quarantine_s`` (longer than any writer's lease), and the slot
                too is kept out of use that long.
              Held (cached) blocks are never a transfer's target, so they are let go at once.
              Blocks a transfer wrote are registered in the prefix cache only once the request
              joined the batch (every write in): an aborted transfer never poisons the cache.
    expiry    a reservation whose Decode never comes fails at the end of its lease.
    colocated ServeColocated: prefilled and decoded here, no KV transfer (``transfer`` None: no
              slot, no lease, the counter never touched)                     -> DECODING

Threads and locks: ``decode-loop`` owns the generator. Two locks, always taken in this order:
the `StepGate` (the generator; the loop holds it for a whole step and lets RPC threads in between
steps) and ``_state`` (reservations, the quarantine, draining; held only for bookkeeping). Reserve,
Decode, the load report and most Aborts take ``_state`` alone, so they never wait for a step; the
block allocator is thread-safe. RPC callers never wait for KV or tokens: outputs reach them
through their `Sink`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from decode.arrivals import DecodeArrivals
from decode.reservation import Reservation, ResState, TransferSlot
from decode.sink import Sink
from engine.block_hash import block_hashes
from engine.config import SchedulerConfig
from engine.errors import CapacityError, InvalidRequestError, TensorParallelError
from engine.ids import BlockId
from engine.generator import Generator, StepOutput
from engine.grammar import Grammars, matcher_for
from engine.kv_cache import GROWTH_GAP_BLOCKS, blocks_needed
from engine.sampling import SamplingParams
from engine.sequence import FinishReason
from kvtransfer import KVTransferError, PeerLostError, SlotState, TransferError, TransferTimeout
from worker.async_sink import put_each
from worker.errors import DrainingError, UnknownRequestError
from worker.gate import StepGate
from worker.liveness import LoopWatch
from worker.runtime import WorkerResources
from worker.validate import check_request_id

log = logging.getLogger(__name__)

MAX_WRITES_PER_REQUEST = 1 << 24   # far above any plan: layers x 2 x blocks


@dataclass(frozen=True)
class DecodeLoad:
    """A decode worker's load: blocks, sequences decoding or queued, reservations not decoding."""

    free_blocks: int
    total_blocks: int
    running: int
    waiting_kv: int
    reserved_blocks: int
    draining: bool


class DecodeWorker:
    """Reservations + KV arrival counting + the decode loop over one KV pool.

    Args:
        res: the worker's resources; ``res.transfer`` must deliver arrivals to ``arrivals``.
        arrivals: the `DecodeArrivals` the transfer engine feeds.
    """

    def __init__(self, res: WorkerResources, arrivals: DecodeArrivals):
        c = res.config
        self.res = res
        self.arrivals = arrivals
        self.counter = arrivals.counter
        arrivals.on_lost.append(self._writer_lost)
        tok = res.loaded.tokenizer
        self.gen = Generator(res.loaded.model, res.pool, None,
                             SchedulerConfig(max_num_seqs=c.max_num_seqs,
                                             max_num_batched_tokens=c.max_num_batched_tokens,
                                             max_prefill_tokens_while_decoding=c.max_prefill_tokens_while_decoding,
                                             max_prefill_seconds_while_decoding=c.max_prefill_seconds_while_decoding,
                                             prefix_caching=c.prefix_caching,
                                             parallel_min_tokens=c.parallel_min_tokens,
                                             prefill_batch_tokens=c.prefill_batch_tokens or c.max_num_batched_tokens),
                             grammars=Grammars(tok, tok.stop_token_ids) if tok is not None else None)
        self.gen.runner.borrowing = res.lending   # colocated prompt chunks may borrow an idle CPU
        if c.device != "cpu" and not c.enforce_eager:   # vLLM's default on a GPU: decode from CUDA graphs
            try:
                seconds = self.gen.runner.enable_cuda_graphs(c.max_num_seqs)
                log.info("recorded CUDA graphs of the decode step for up to %d sequences in %.1f s",
                         c.max_num_seqs, seconds)
            except ValueError as exc:
                log.warning("decode steps run eagerly: %s", exc)
        self._model = res.loaded.config
        self._lock = StepGate()   # the generator: the loop holds it per step, RPCs get in between
        self._state = threading.Condition()   # reservations, quarantine, draining, metrics
        self._wake = threading.Event()   # work arrived (a request, a completed slot)
        arrivals.on_done.append(self._wake.set)
        self._reservations: dict[str, Reservation] = {}
        self._waiting_kv: dict[str, Reservation] = {}
        # (expiry, blocks, writers that may still write into them)
        self._quarantine: list[tuple[float, list[BlockId], set[str]]] = []
        self._groups: dict[str, frozenset[str]] = {}   # writer endpoint id -> its TP group's ids
        self._draining = False
        self._stop = threading.Event()
        self.metrics = {"transfers_completed": 0, "transfers_failed": 0, "reservations_expired": 0,
                        "blocks_quarantined": 0, "requests_finished": 0, "requests_aborted": 0,
                        "sequences_failed": 0, "blocks_held_at_reserve": 0}
        self.watch = LoopWatch("decode-loop")
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.watch.attach(self._thread)
        self._thread.start()

    # -- RPC-facing operations ----------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                prompt_token_ids: list[int] | None = None, writers: Iterable[str] = ()) -> Reservation:
        """Allocate blocks for the prompt and a transfer slot for ``transfer_timeout_s``.

        ``writers``: the endpoint ids of the ranks that will write the KV, when the caller knows
        them. A transfer that fails before every write is in frees its blocks once all of them,
        and all that wrote, have lost their connection (none written yet included).

        With prefix caching and ``prompt_token_ids`` (``num_prompt_tokens`` of them), the blocks
        holding its longest cached prefix come first (``num_held_blocks`` of them, a reference each);
        only the rest is allocated, and only the rest is for the prefill worker to write.

        Raises:
            InvalidRequestError (bad id, counts or prompt, duplicate id), DrainingError,
            CapacityError (pool or slots full; nothing is held).
        """
        check_request_id(request_id)
        if not 1 <= num_prompt_tokens < self._model.max_position:
            raise InvalidRequestError(f"num_prompt_tokens must be in [1, {self._model.max_position}), "
                                      f"got {num_prompt_tokens}")
        if not 1 <= max_tokens <= self._model.max_position - num_prompt_tokens:
            raise InvalidRequestError(f"max_tokens {max_tokens} does not fit the context with "
                                      f"{num_prompt_tokens} prompt tokens")
        if prompt_token_ids:
            vocab = self._model.vocab_size
            if len(prompt_token_ids) != num_prompt_tokens or not all(0 <= t < vocab for t in prompt_token_ids):
                raise InvalidRequestError(f"prompt_token_ids must be {num_prompt_tokens} token ids "
                                          f"in [0, {vocab})")
        bs, alloc = self.res.pool.block_size, self.res.pool.allocator
        need = blocks_needed(num_prompt_tokens, bs)
        hashes = (block_hashes(prompt_token_ids, bs)
                  if prompt_token_ids and self.res.config.prefix_caching else [])
        lease = self.res.config.transfer_timeout_s
        with self._state:
            if self._draining:
                raise DrainingError("decode worker is draining")
            if request_id in self._reservations:
                raise InvalidRequestError(f"request {request_id!r} is already reserved")
            taken = alloc.allocate_after_prefix(hashes, need, gap=GROWTH_GAP_BLOCKS)
            if taken is None:
                raise CapacityError(f"KV pool full: {need} blocks requested (less any cached), "
                                    f"{alloc.num_free} of {alloc.num_blocks} free")
            blocks, held = taken
            try:
                slot, generation = self.counter.acquire(lease)
            except TransferError as exc:
                alloc.free(blocks)
                raise CapacityError(str(exc)) from exc
            r = Reservation(request_id, blocks, TransferSlot(slot, generation), num_prompt_tokens,
                            time.monotonic() + lease, num_held_blocks=held,
                            reserved_prompt=list(prompt_token_ids) if prompt_token_ids else None,
                            writers=frozenset(writers))
            self.metrics["blocks_held_at_reserve"] += held
            self._reservations[request_id] = r
            return r

    def start_decode(self, request_id: str, first_tokens: list[int], num_writes: int,
                     prompt_token_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue the request behind its KV transfer; returns at once.

        Outputs (or the transfer's `KVTransferError`) go to ``sink``. The arguments are checked
        first: when they are wrong nothing changes (the reservation stays for the caller's Abort).

        Raises:
            UnknownRequestError: no reservation waiting for its Decode.
            InvalidRequestError: prompt not of the reserved length or outside the vocabulary,
                ``first_tokens`` not one per choice or outside the vocabulary, ``num_writes`` out
                of range, a grammar that does not compile or rejects a first token.
        """
        vocab = self._model.vocab_size
        firsts = list(first_tokens)
        if len(firsts) != params.n or not all(0 <= t < vocab for t in firsts):
            raise InvalidRequestError(f"{params.n} first tokens inside the vocabulary [0, {vocab}) expected, "
                                      f"got {firsts[:20]}")
        if not 0 <= num_writes <= MAX_WRITES_PER_REQUEST:
            raise InvalidRequestError(f"num_writes {num_writes} out of range")
        self.gen.runner.validate(prompt_token_ids, params)
        for t in firsts:   # compiles the grammar now (cached), so joining the batch later cannot fail
            matcher_for(self.gen.grammars, params, prompt_token_ids, [t] if t not in params.stop_token_ids else [])
        with self._state:
            r = self._reservations.get(request_id)
            if r is None or r.state != ResState.RESERVED:
                raise UnknownRequestError(f"no reservation waiting for its Decode: {request_id!r}")
            if len(prompt_token_ids) != r.num_prompt_tokens:
                raise InvalidRequestError(f"the prompt has {len(prompt_token_ids)} tokens; "
                                          f"{r.num_prompt_tokens} were reserved")
            if r.reserved_prompt is not None and list(prompt_token_ids) != r.reserved_prompt:
                raise InvalidRequestError("the prompt differs from the one reserved (its cached "
                                          "blocks were chosen by it)")
            t = r.require_transfer()   # RESERVED: it has one
            try:
                self.counter.expect(t.slot, t.generation, num_writes)
            except TransferError as exc:   # the slot failed or expired a moment ago
                self._fail(r, exc)
                raise UnknownRequestError(f"reservation {request_id!r} is gone: {exc}") from exc
            r.first_tokens, r.prompt_token_ids, r.params, r.sink = firsts, list(prompt_token_ids), params, sink
            r.move(ResState.WAITING_KV)
            self._waiting_kv[request_id] = r
        self._wake.set()

    def serve_colocated(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       sink: Sink) -> None:
        """Colocated serving: prefill and decode here, no transfer; outputs go to ``sink`` (the
        first carries the first token).

        Raises InvalidRequestError / ContextLengthError (nothing changed), CapacityError (prompt
        + max_tokens larger than the pool), DrainingError.
        """
        check_request_id(request_id)
        self.gen.runner.validate(prompt_token_ids, params)
        with self._lock, self._state:
            if self._draining:
                raise DrainingError("decode worker is draining")
            if request_id in self._reservations:
                raise InvalidRequestError(f"request {request_id!r} is already in flight")
            self.gen.add_request(request_id, prompt_token_ids, params)
            r = Reservation(request_id, [], None, len(prompt_token_ids), float("inf"),
                            state=ResState.DECODING, sink=sink)   # no transfer: no slot, no lease
            self._reservations[request_id] = r
        self._wake.set()

    def abort(self, request_id: str, writer_stopped: bool = False) -> bool:
        """Abort a reserved, transferring or decoding request; False if unknown. Only a request
        already decoding waits for the step in progress."""
        with self._state:
            r = self._reservations.get(request_id)
            if r is None:
                return False
            r.writer_stopped = r.writer_stopped or writer_stopped
            if r.state in (ResState.RESERVED, ResState.WAITING_KV):   # a colocated one never is
                t = r.require_transfer()
                self.counter.fail(t.slot, t.generation, TransferError("aborted"))
                self._fail(r, TransferError(f"request {request_id} was aborted"))
                self.metrics["requests_aborted"] += 1
                return True
        with self._lock, self._state:
            r = self._reservations.get(request_id)
            if r is not None and r.state == ResState.DECODING:
                out = self.gen.abort(request_id)
                if out is not None:
                    self._finish(r, out)
            self.metrics["requests_aborted"] += 1
            return True

    def detach(self, request_id: str) -> None:
        """The request's stream ended before it finished (the caller went away). A decoding
        request is aborted; one still waiting for its KV is dropped as soon as the KV is in
        (then no write can land any more), or fails at its lease like any other. Nothing is
        claimed about the writer: only an Abort with ``writer_stopped`` frees blocks early."""
        with self._state:
            r = self._reservations.get(request_id)
            if r is None or r.state != ResState.DECODING:
                if r is not None:
                    r.detached, r.sink = True, None
                return
        self.abort(request_id)

    def load(self) -> DecodeLoad:
        """Never waits for a step (the sequence counts are read without the generator's lock)."""
        with self._state:
            reserved = [r for r in self._reservations.values()
                        if r.state in (ResState.RESERVED, ResState.WAITING_KV)]
            return DecodeLoad(self.res.pool.allocator.num_free, self.res.pool.num_blocks,
                              len(self.gen.running) + len(self.gen.waiting), len(reserved),
                              sum(len(r.blocks) for r in reserved), self._draining)

    def in_flight(self) -> int:
        with self._state:
            return len(self._reservations)

    def drain(self, timeout_s: float) -> None:
        """Refuse new reservations; wait up to ``timeout_s`` for in-flight requests to finish."""
        end = time.monotonic() + timeout_s
        with self._state:
            self._draining = True
            while self._reservations and time.monotonic() < end:
                self._state.wait(0.2)

    def close(self) -> None:
        """Stop and join the decode loop; abort what is left."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self.watch.stopped()
        with self._lock, self._state:
            for rid in list(self._reservations):
                r = self._reservations[rid]
                if r.state == ResState.DECODING:
                    out = self.gen.abort(rid)
                    if out is not None:
                        self._finish(r, out)
                elif r.state in (ResState.RESERVED, ResState.WAITING_KV):
                    self._fail(r, TransferError("decode worker closed"))

    # -- internals (called with ``_state`` held; those touching the generator with the gate too) --
    def _fail(self, r: Reservation, error: KVTransferError, writer_done: bool = False) -> None:
        """Fail a reservation before it decodes; ``writer_done``: no write can still land."""
        if r.state in (ResState.FAILED, ResState.DONE):
            return
        t = r.require_transfer()   # only a reservation waiting for its KV fails
        r.move(ResState.FAILED)
        self._waiting_kv.pop(r.request_id, None)
        touched = set(self.counter.writers(t.slot, t.generation))
        # A writer that touched the blocks stands for its whole tensor-parallel group: a rank of it
        # that has not written yet may still (`add_writer_group`). So do the ranks named at
        # Reserve, which may not have written at all.
        writers = set(r.writers).union(*(self._groups.get(w, {w}) for w in touched))
        # A writer with no connection left cannot land anything, and that was told before this
        # quarantine existed (`_writer_lost` will not come again): it is no longer waited for.
        # Every writer gone (a killed prefill worker is seen by the data plane before the router
        # aborts): nothing can land. A lost connection alone is not enough: a tcp writer's other
        # stream may still be landing a write (`kvtransfer.connection.PeerConnections`).
        alive = writers - self.arrivals.lost
        stopped = (writer_done or r.writer_stopped or (bool(writers) and not alive)
                   or (isinstance(error, PeerLostError) and not writers))
        self.counter.release(t.slot, t.generation, 0.0 if stopped else self.res.config.quarantine_s)
        self.metrics["transfers_failed"] += 1
        held, written = r.blocks[:r.num_held_blocks], r.blocks[r.num_held_blocks:]
        self.res.pool.allocator.free(held)   # cached blocks: no transfer writes them
        if stopped:
            self.res.pool.allocator.free(written)
        elif written:
            self._quarantine.append((time.monotonic() + self.res.config.quarantine_s, written, alive))
            self.metrics["blocks_quarantined"] += len(written)
        if r.sink is not None:
            r.sink.put(error)
        del self._reservations[r.request_id]
        self._state.notify_all()

    def _finish(self, r: Reservation, out: StepOutput, deliveries: list | None = None) -> None:
        """``out`` to ``r``'s sink (appended to ``deliveries`` for the caller to hand over
        together, `worker.async_sink.put_each`), and the request's end when it finished."""
        if deliveries is None:
            r.sink.put(out)
        else:
            deliveries.append((r.sink, out))
        if out.request_finished and r.state == ResState.DECODING:
            r.move(ResState.DONE)
            del self._reservations[r.request_id]
            key = "sequences_failed" if out.finish_reason == FinishReason.ERROR else "requests_finished"
            self.metrics[key] += 1
            self._state.notify_all()

    def _admit_arrived(self) -> bool:
        """Join every request whose KV arrived to the batch; fail those whose transfer failed.
        True if any changed."""
        changed = False
        for r in list(self._waiting_kv.values()):
            t = r.require_transfer()
            st = self.counter.state(t.slot)
            if st.generation != t.generation or st.state == SlotState.FREE:
                self._fail(r, TransferError(f"slot of {r.request_id} was released"))
            elif st.state == SlotState.FAILED:
                self._fail(r, st.error or TransferError("transfer failed"))
            elif st.state == SlotState.COMPLETE and r.detached:   # every write is in: none can land
                self._fail(r, TransferError(f"{r.request_id}: nobody reads it"), writer_done=True)
            elif st.state == SlotState.COMPLETE:
                self._start(r)
            else:
                continue
            changed = True
        return changed

    def _start(self, r: Reservation) -> None:
        del self._waiting_kv[r.request_id]
        try:
            self.res.transfer.flush_arrivals()   # GPUDirect: the bytes are visible to kernels from here
            done = self.gen.add_prefilled(r.request_id, r.prompt_token_ids, r.first_tokens, r.blocks, r.params)
        except Exception as exc:   # checked in start_decode; a bug here fails this request alone
            log.exception("request %s could not join the batch", r.request_id)
            self._fail(r, TransferError(f"could not join the batch: {exc}"), writer_done=True)
            return
        t = r.require_transfer()
        self.counter.release(t.slot, t.generation)
        self.metrics["transfers_completed"] += 1
        r.move(ResState.DECODING)
        for out in done:
            self._finish(r, out)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        self.counter.expire_overdue()
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

    def add_writer_group(self, endpoint_ids) -> None:
        """A prefill worker's ranks' endpoint ids (Connect): a failed transfer that any of them
        touched frees its blocks only once every one of them is gone (or the quarantine ends)."""
        group = frozenset(endpoint_ids)
        with self._state:
            for e in group:
                self._groups[e] = group

    def _writer_lost(self, source: str) -> None:
        """A writer's connection is gone: it can no longer write into the blocks it touched."""
        with self._state:
            keep = []
            for until, blocks, writers in self._quarantine:
                if source in writers:
                    writers.discard(source)
                    if not writers:
                        self.res.pool.allocator.free(blocks)
                        continue
                keep.append((until, blocks, writers))
            self._quarantine = keep
        self._wake.set()

    def _step(self) -> None:
        """One generator step (gate held), then its outputs to their requests."""
        try:
            outputs = self.gen.step()
        except Exception as exc:  # a bug in a step must not kill the worker silently
            log.exception("decode step failed; aborting the running batch")
            if isinstance(exc, TensorParallelError):   # a rank is gone: so is this worker
                self.res.lose(f"tensor-parallel group broken: {exc}")
            outputs = [o for rid in [s.request_id for s in self.gen.running + list(self.gen.waiting)]
                       if (o := self.gen.abort(rid)) is not None]
        deliveries: list = []
        with self._state:
            for out in outputs:
                r = self._reservations.get(out.request_id)
                if r is not None:
                    self._finish(r, out, deliveries)
            put_each(deliveries)   # the step's tokens: one wake-up of the RPC server's loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.watch.tick()
            self._wake.clear()
            busy = False
            with self.watch.guard("decode iteration"):
                with self._lock:
                    with self._state:
                        self._housekeeping()
                        self._admit_arrived()
                    busy = self.gen.has_unfinished()
                    if self.res.lending is not None:   # the CPU is lent while the loop waits
                        self.res.lending.busy(busy)
                    if busy:
                        self._step()
            if busy:
                self._lock.yield_to_waiters()   # RPCs (Abort, load, Stats) go before the next step
            else:
                self._wake.wait(0.25)
