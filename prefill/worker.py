"""The prefill worker's core: batch waiting prompts, chunk long ones, post KV writes layer by layer.

Lifecycle of a job (states in `prefill.job`):

    submit      arguments checked (nothing changes when they are wrong); QUEUED: waits for source
                blocks (the local pool) and a place in a batch
    compute     COMPUTING: the ``prefill-loop`` thread runs forward passes; a prompt longer than
                ``max_num_batched_tokens`` takes several passes (chunks). In the pass that holds
                the prompt's LAST chunk, the writes of its K and V (every block, planned by
                `kvtransfer.plan_writes`, each carrying the immediate (slot, generation)) are
                posted to the decode worker: each layer's as the layer finishes, or all once the
                pass ends (`WorkerConfig.kv_send`). The first token is sampled.
                Delta transfer: the prompt's first ``num_held_blocks`` blocks, which the decode
                worker already holds, are neither planned nor written (nor counted).
    transfer    TRANSFERRING: the ``prefill-sender`` thread waits for every posted write to
                complete
    done        DONE / FAILED: the source blocks are freed only now, after every posted write
                completed or failed (the engine no longer reads them); the job is finished and
                its done callbacks run.

``num_writes`` is the count of the deterministic plan over all layers, so it equals the number of
immediates the decode worker will count. Every job has a lease: ``prefill_timeout_s`` from submit,
shortened to the ``write_deadline_s`` the router passes (what is left of the decode reservation);
no write is posted past it, and a job still queued then fails with `PrefillTimeout`. An aborted or
failed job stops posting at the next layer; it is finished once its posted writes completed,
which is the "abort acknowledged" the decode side's block-reuse rule relies on. A failure of one
job (its plan, its sampling, its peer) never fails its batch-mates.

Warm-ups (`warm`, prefix caching only; `prefill.warmup`): computing a finished request's prompt +
output into the prefix cache, lowest priority, preempted between layers by any prefill, and with
CPU lending run only while the workers that may borrow this CPU wait for work.

Passes run through the engine's `engine.runner.ModelRunner` (blocks, prefix cache, forward,
sampling) and their prompts are chosen by `engine.scheduling.fill_pass`, as in the generator; the
writes and their completion are `prefill.sender.KVSender`'s.

Threads: ``prefill-loop`` (scheduling and forward passes) and ``prefill-sender`` (transfer
completion and retirement); RPC callers never block: they get the job and a done callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from engine.attention import SeqChunk
from engine.errors import CapacityError, InvalidRequestError
from engine.grammar import Grammars, matcher_for
from engine.kv_cache import blocks_needed
from engine.models.base import check_pool
from engine.runner import ModelRunner
from engine.sampling import Row, SamplingParams, child_params
from engine.scheduling import PassBudget, RateMeter, by_response_ratio, default_batch_tokens, fill_pass
from engine.tp_ranks import LayerWork
from kvtransfer.group import GroupEndpoint
from kvtransfer.immediate import GENERATION_MODULUS, MAX_SLOTS
from prefill.job import JobState, PrefillJob, PrefillLoad, check_destination
from prefill.sender import KVSender
from prefill.warmup import Preempted, WarmupQueue
from worker.errors import CacheDisabledError, DrainingError, PrefillAborted, PrefillError, PrefillTimeout
from worker.liveness import LoopWatch
from worker.runtime import WorkerResources
from worker.validate import check_request_id, check_seconds

log = logging.getLogger(__name__)


class PrefillWorker:
    """Prefill scheduler + KV sender over the worker's resources."""

    def __init__(self, res: WorkerResources):
        self.res = res
        c = res.config
        check_pool(res.loaded.model, res.pool)
        self.runner = ModelRunner(res.loaded.model, res.pool, c.prefix_caching, c.parallel_min_tokens,
                                  borrowing=res.lending)
        self._lock = threading.Condition()
        self._queue: deque[PrefillJob] = deque()
        self._jobs: dict[str, PrefillJob] = {}
        self._warmups = WarmupQueue(res.pool, c.prefill_timeout_s)   # run when _queue is empty
        self._draining = False
        self._stop = threading.Event()
        self._batch_tokens = c.prefill_batch_tokens or default_batch_tokens(c.device, c.max_num_batched_tokens)
        self._rate = RateMeter()   # prefill tokens/s, for the response ratios
        self.metrics = {"prefills_completed": 0, "prefills_failed": 0, "prefills_aborted": 0,
                        "kv_bytes_sent": 0, "kv_bytes_skipped": 0, "prompt_tokens": 0,
                        "prefix_hit_tokens": 0, "warmups_completed": 0, "warmups_dropped": 0,
                        "warmup_tokens_computed": 0, "warmup_preemptions": 0}
        tok = res.loaded.tokenizer
        self.grammars = Grammars(tok, tok.stop_token_ids) if tok is not None else None
        self.sender = KVSender(res, self._retire)
        self.watches = (LoopWatch("prefill-loop"), self.sender.watch)
        self._thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)
        self.watches[0].attach(self._thread)
        self._thread.start()

    # -- peers ------------------------------------------------------------------------------------
    def connect(self, decode_worker_id: str, info: GroupEndpoint) -> None:
        """`KVSender.connect`."""
        self.sender.connect(decode_worker_id, info)

    def disconnect(self, decode_worker_id: str) -> None:
        self.sender.disconnect(decode_worker_id)

    # -- jobs --------------------------------------------------------------------------------------
    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, decode_worker_id: str,
               dst_blocks: list[int], slot: int, generation: int, write_deadline_s: float = 0.0,
               num_held_blocks: int = 0) -> PrefillJob:
        """Check the arguments, then queue a job; returns at once (see `PrefillJob` for how the
        outcome arrives).

        ``num_held_blocks``: the decode worker already holds the prompt's first
        ``num_held_blocks`` blocks (full ones); ``dst_blocks`` are the destinations of the blocks
        after them.

        Raises (nothing queued): InvalidRequestError (prompt, sampling, block ids not distinct
        or outside the peer's pool, wrong block count, slot/generation out of range, bad
        deadline, duplicate id), CapacityError (prompt larger than the whole local pool),
        DrainingError, PrefillError (decode peer not connected).
        """
        check_request_id(request_id)
        check_seconds("write_deadline_s", write_deadline_s)
        self.runner.validate(token_ids, params)
        if not 0 <= slot < MAX_SLOTS or not 0 <= generation < GENERATION_MODULUS:
            raise InvalidRequestError(f"slot {slot} / generation {generation} out of range")
        peer = self.sender.peers.get(decode_worker_id)
        if peer is None:
            raise PrefillError(f"not connected to decode worker {decode_worker_id!r}")
        check_destination(len(token_ids), dst_blocks, num_held_blocks, peer.layout.num_blocks,
                          self.res.pool.block_size)
        need = blocks_needed(len(token_ids), self.res.pool.block_size)
        if need > self.res.pool.num_blocks:
            raise CapacityError(f"prompt needs {need} blocks; the prefill pool holds {self.res.pool.num_blocks}")
        lease = self.res.config.prefill_timeout_s
        if write_deadline_s > 0:
            lease = min(lease, write_deadline_s)
        job = PrefillJob(request_id, list(token_ids), params, peer, list(dst_blocks), slot, generation,
                         time.monotonic() + lease, num_held_blocks=num_held_blocks, peer_id=decode_worker_id)
        job.matcher = matcher_for(self.grammars, params, token_ids)
        with self._lock:
            if self._draining:
                raise DrainingError("prefill worker is draining")
            if request_id in self._jobs:
                raise InvalidRequestError(f"request {request_id!r} is already being prefilled")
            self._jobs[request_id] = job
            self._queue.append(job)
            self._lock.notify_all()
        return job

    def warm(self, request_id: str, token_ids: list[int]) -> PrefillJob:
        """Queue a warm-up of ``token_ids``' full blocks into the prefix cache (`prefill.warmup`);
        returns at once with the job (``job.finished`` is set once it ran or was dropped;
        dropped: ``job.error`` is a `WarmupDropped`).

        Raises (nothing queued): CacheDisabledError (prefix caching off), InvalidRequestError
        (bad id or tokens), CapacityError (`prefill.warmup.MAX_QUEUED` queued), DrainingError.
        """
        if not self.res.config.prefix_caching:
            raise CacheDisabledError("this prefill worker runs without a prefix cache (--prefix-caching)")
        check_request_id(request_id)
        self.runner.validate(token_ids, SamplingParams(max_tokens=1))
        with self._lock:
            if self._draining:
                raise DrainingError("prefill worker is draining")
            job = self._warmups.add(request_id, token_ids)
            self._lock.notify_all()
        return job

    def abort(self, request_id: str) -> PrefillJob | None:
        """Stop a job (it posts no more writes); returns it (wait on ``job.finished``: set once
        its posted writes completed), or None if unknown. Never blocks."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return None
            job.fail(PrefillAborted(f"request {request_id} aborted"))
            queued = job.state == JobState.QUEUED
            if queued:
                self._queue.remove(job)
        if queued:
            self._retire(job)
        return job

    def load(self) -> PrefillLoad:
        with self._lock:
            queued = sum(len(j.prompt_token_ids) - j.num_computed for j in self._queue)
            return PrefillLoad(self.res.pool.allocator.num_free, self.res.pool.num_blocks, len(self._jobs),
                               queued, self._draining)

    def drain(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        with self._lock:
            self._draining = True
            dropped = self._warmups.drop(running=False, why="the worker is draining")
        for job in dropped:
            self.sender.finish(job)
        with self._lock:
            while self._jobs and time.monotonic() < end:
                self._lock.wait(0.2)

    def close(self) -> None:
        """Fail queued jobs, stop and join both threads."""
        self._stop.set()
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for job in queued:
            job.fail(PrefillError("prefill worker closed"))
            self._retire(job)
        self._thread.join(timeout=30)
        with self._lock:
            dropped = self._warmups.drop(running=True, why="the worker is stopping")
        for job in dropped:
            self.sender.finish(job)
        self.sender.close()
        self.watches[0].stopped()

    def _retire(self, job: PrefillJob) -> None:
        """Free the job's source blocks, account it, finish it (its writes are all complete)."""
        with self._lock:
            self.runner.release(job)
            job.move(JobState.FAILED if job.error else JobState.DONE)
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]
            if job.warm:
                key = "warmups_dropped" if job.error else "warmups_completed"
            else:
                key = ("prefills_aborted" if job.aborted else "prefills_failed" if job.error
                       else "prefills_completed")
            self.metrics[key] += 1
            self._lock.notify_all()
        job.set_finished()

    # -- the loop ------------------------------------------------------------------------------------
    def _expire_queued(self) -> list[PrefillJob]:
        now = time.monotonic()
        expired = [j for j in self._queue if now >= j.deadline]
        for job in expired:
            self._queue.remove(job)
            job.fail(PrefillTimeout(f"prefill of {job.request_id} waited past its lease"))
        return expired

    def _schedule(self) -> list[tuple[PrefillJob, SeqChunk]]:
        """The next pass: queued prompts by response ratio (`engine.scheduling`), else a warm-up
        chunk."""
        for job in [j for j in self._queue if j.stopped]:   # aborted or failed between passes:
            self._queue.remove(job)                         # retire it, compute no more
            self.sender.finish(job)
        remaining = {j.request_id: self.runner.tokens_to_compute(j) for j in self._queue}   # one lookup each
        order = by_response_ratio(self._queue, time.monotonic(), self._rate.tokens_per_s,
                                  lambda j: j.queued_at, lambda j: remaining[j.request_id])
        budget = PassBudget(self.res.config.max_num_batched_tokens, self._batch_tokens)
        batch = []
        for job, take in fill_pass(order, budget, lambda j: remaining[j.request_id],
                                   lambda j, _: bool(j.block_table) or self._take_blocks(j)):
            end = job.num_computed + min(take, len(job.prompt_token_ids) - job.num_computed)
            batch.append((job, SeqChunk(job.prompt_token_ids[job.num_computed:end], job.num_computed,
                                        job.block_table, need_logits=end == len(job.prompt_token_ids),
                                        prompt_logits=job.params.prompt_logprobs is not None)))
        if not self._queue and self._neighbour_busy():   # deferred: only the expired leave
            for job in self._warmups.expire():
                self.sender.finish(job)
        elif not self._queue:
            batch += self._warmups.next_chunk(self.res.config.warmup_chunk_tokens, self._take_blocks,
                                              self.sender.finish)
        return batch

    def _take_blocks(self, job: PrefillJob) -> bool:
        """Give ``job`` its local blocks, all or none: with prefix caching, the cached blocks of its
        longest cached prefix first (not computed again), fresh ones for the rest. False (nothing
        taken) when the pool cannot hold it now; else the job is COMPUTING."""
        hit = self.runner.take_cached_prefix(job)
        if not self.runner.grow(job, len(job.prompt_token_ids)):
            self.runner.reset(job)
            return False
        job.prefix_hit_tokens = hit
        if not job.warm:
            self.metrics["prefix_hit_tokens"] += hit
        job.move(JobState.COMPUTING)
        return True

    def _loop(self) -> None:
        watch = self.watches[0]
        while not self._stop.is_set():
            watch.tick()
            batch: list = []
            with watch.guard("scheduling"):
                with self._lock:
                    for job in self._expire_queued():
                        self.sender.finish(job)   # no handles: retired at once, off this lock
                    batch = self._schedule()
                    if self.res.lending is not None:   # the CPU is lent while the loop waits
                        self.res.lending.busy(bool(batch))
                    if not batch:
                        self._lock.wait(0.25)
            if not batch:
                continue
            try:
                self._run(batch)
            except Preempted:   # the warm-up stays first in line, its chunk not counted
                self.metrics["warmup_preemptions"] += 1
            except Exception as exc:  # the forward pass itself failed: fail the batch, keep serving
                log.exception("prefill pass failed")
                with self._lock:
                    for job, _ in batch:
                        job.fail(PrefillError(f"prefill failed: {exc}"))
                        if job in self._queue:
                            self._queue.remove(job)
                        self._warmups.remove(job)
                for job, _ in batch:
                    self.sender.finish(job)

    def _neighbour_busy(self) -> bool:
        """With CPU lending (`worker.cpu_board`), whether a worker that may borrow this one's CPU
        has work: a warm-up (speculative) then waits, and the idle CPU goes to that worker's
        passes instead (measured: docs/PERFORMANCE.md, "Warm-ups yield the CPU to a busy decode
        worker")."""
        return self.res.lending is not None and self.res.lending.owners_busy()

    def _yield_to_prefills(self, layer: int) -> None:
        """A warm-up pass's layer callback: raise `Preempted` once a prefill is queued or a
        neighbour that may borrow the CPU has work (`_neighbour_busy`; read without the lock: a
        stale answer costs one layer)."""
        if self._queue:
            raise Preempted(f"a prefill arrived at layer {layer}")
        if self._neighbour_busy():
            raise Preempted(f"the worker lending this CPU has work at layer {layer}")

    def _run(self, batch: list[tuple[PrefillJob, SeqChunk]]) -> None:
        t0 = time.monotonic()
        finishing = [job for job, chunk in batch if chunk.need_logits]
        per_layer = self.sender.per_layer
        on_layer = (lambda layer: self.sender.post_layers((layer,), finishing)) if finishing and per_layer else None
        work = self.sender.rank_work(finishing) if finishing else None
        if work:   # tensor parallel: the other ranks post their heads' writes at the same points
            on_layer = LayerWork(on_layer, work)
        if all(job.warm for job, _ in batch):   # a warm-up pass (never batched with prefills)
            on_layer = self._yield_to_prefills
        logits = self.runner.execute(batch, on_layer_done=on_layer)
        if finishing and not per_layer:
            self.sender.post_layers(range(self.res.layout.num_layers), finishing)
        rows, index = [], []
        for i, j in enumerate(finishing):   # n > 1: one row per choice, on the same logits
            for c in range(j.params.n):
                p = child_params(j.params, c) if j.params.n > 1 else j.params
                rows.append(Row(p, p.make_generator(), j.prompt_token_ids,
                                stop_token_ids=frozenset(p.stop_token_ids),
                                matcher=j.matcher))   # read only here: the choices share it
                index.append(i)
        drawn = self.runner.sample(logits, rows, index)
        elapsed = time.monotonic() - t0
        self._rate.add(sum(len(c.token_ids) for _, c in batch), elapsed)
        with self._lock:
            for job, chunk in batch:
                self.runner.advance(job, len(chunk.token_ids), register=not job.stopped)
                job.compute_seconds += elapsed
                if job.warm:
                    self.metrics["warmup_tokens_computed"] += len(chunk.token_ids)
                    if self._warmups.chunk_done(job):
                        self.sender.finish(job)
            at = 0
            for job in finishing:
                job.set_first_tokens(drawn[at:at + job.params.n], rows[at:at + job.params.n],
                                     self.res.loaded.config.max_position)
                at += job.params.n
                if not job.stopped:
                    self.sender.count(job)
                self.metrics["kv_bytes_sent"] += job.bytes_posted
                self.metrics["kv_bytes_skipped"] += job.bytes_skipped
                self.metrics["prompt_tokens"] += len(job.prompt_token_ids)
                if job in self._queue:
                    self._queue.remove(job)
                job.move(JobState.TRANSFERRING)
        for job in finishing:
            self.sender.finish(job)
