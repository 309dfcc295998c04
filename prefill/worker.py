"""The prefill worker's core: batch waiting prompts, chunk long ones, post KV writes layer by layer.

Lifecycle of a job (states in `prefill.job`):

    submit      arguments checked (nothing changes when they are wrong); QUEUED: waits for source
                blocks (the local pool) and a place in a batch
    compute     COMPUTING: the ``prefill-loop`` thread runs forward passes; a prompt longer than
                ``max_num_batched_tokens`` takes several passes (chunks). In the pass that holds
                the prompt's LAST chunk, as each layer finishes, the writes of that layer (K and V
                of every block, planned by `kvtransfer.plan_writes`, each carrying the immediate
                (slot, generation)) are posted to the decode worker. The first token is sampled.
                Delta transfer: the first ``num_held`` blocks of the prompt, which the decode
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
output into the prefix cache, lowest priority, preempted between layers by any prefill.

Threads: ``prefill-loop`` (scheduling and forward passes) and ``prefill-sender`` (transfer
completion and retirement); RPC callers never block: they get the job and a done callback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.block_hash import block_hashes
from engine.errors import CapacityError, InvalidRequestError
from engine.generator import validate_request
from engine.kv_cache import blocks_needed
from engine.grammar import Grammars, matcher_for
from engine.sampling import (Row, SamplingError, SamplingParams, child_params, compute_logprobs,
                             prompt_logprobs_of, sample)
from kvtransfer import (KVLayout, KVTransferError, TransferError, count_writes, pack_immediate,
                        plan_writes, to_write_ops)
from kvtransfer.immediate import GENERATION_MODULUS, MAX_SLOTS
from prefill.job import DecodePeer, JobState, PrefillJob
from engine.scheduling import PassBudget, RateMeter, by_response_ratio, default_batch_tokens
from prefill.warmup import Preempted, WarmupQueue
from worker.errors import CacheDisabledError, DrainingError, PrefillAborted, PrefillError, PrefillTimeout
from worker.liveness import LoopWatch
from worker.runtime import WorkerResources
from worker.validate import check_request_id, check_seconds

log = logging.getLogger(__name__)

_TRANSFER_GRACE_S = 10.0   # how long past its lease the sender waits for a job's posted writes


@dataclass(frozen=True)
class PrefillLoad:
    """A prefill worker's load: blocks, jobs in flight, prompt tokens not yet computed."""

    free_blocks: int
    total_blocks: int
    jobs: int
    queued_prompt_tokens: int
    draining: bool


class PrefillWorker:
    """Prefill scheduler + KV sender over the worker's resources."""

    def __init__(self, res: WorkerResources):
        self.res = res
        self.peers: dict[str, DecodePeer] = {}
        self._lock = threading.Condition()
        self._queue: deque[PrefillJob] = deque()
        self._jobs: dict[str, PrefillJob] = {}
        self._warmups = WarmupQueue(res.pool, res.config.prefill_timeout_s)   # run when _queue is empty
        self._sending: queue.SimpleQueue[PrefillJob | None] = queue.SimpleQueue()
        self._draining = False
        self._stop = threading.Event()
        c = res.config
        self._batch_tokens = c.prefill_batch_tokens or default_batch_tokens(c.device, c.max_num_batched_tokens)
        self._rate = RateMeter()   # prefill tokens/s, for the response ratios
        self.metrics = {"prefills_completed": 0, "prefills_failed": 0, "prefills_aborted": 0,
                        "kv_bytes_sent": 0, "kv_bytes_skipped": 0, "prompt_tokens": 0,
                        "prefix_hit_tokens": 0, "warmups_completed": 0, "warmups_dropped": 0,
                        "warmup_tokens_computed": 0, "warmup_preemptions": 0}
        self.watches = (LoopWatch("prefill-loop"), LoopWatch("prefill-sender", stall_s=float("inf")))
        tok = res.loaded.tokenizer
        self.grammars = Grammars(tok, tok.stop_token_ids) if tok is not None else None
        self._thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="prefill-sender", daemon=True)
        for watch, thread in zip(self.watches, (self._thread, self._sender)):
            watch.attach(thread)
            thread.start()

    # -- peers ------------------------------------------------------------------------------------
    def connect(self, decode_worker_id: str, info) -> None:
        """Connect the data plane to a decode worker described by ``info`` (`EndpointInfo`).
        Raises `TransferError` (no region, layout mismatch, unreachable), `AuthError`."""
        if not info.regions:
            raise TransferError(f"decode worker {decode_worker_id} registered no memory")
        region = info.regions[0]
        local = self.res.layout
        per_block = local.bytes_per_block
        if region.length % per_block:
            raise TransferError(f"decode pool of {region.length} bytes is not a whole number of blocks "
                                f"of this layout ({per_block} bytes)")
        layout = KVLayout(local.num_layers, region.length // per_block, local.block_size,
                          local.num_kv_heads, local.head_dim, local.itemsize)
        peer = self.res.transfer.connect(info)
        self.peers[decode_worker_id] = DecodePeer(peer, layout, region.key)

    def disconnect(self, decode_worker_id: str) -> None:
        p = self.peers.pop(decode_worker_id, None)
        if p is not None:
            self.res.transfer.disconnect(p.peer)

    # -- jobs --------------------------------------------------------------------------------------
    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, decode_worker_id: str,
               dst_blocks: list[int], slot: int, generation: int, write_deadline_s: float = 0.0,
               num_held: int = 0) -> PrefillJob:
        """Check the arguments, then queue a job; returns at once (see `PrefillJob` for how the
        outcome arrives).

        ``num_held``: the decode worker already holds the prompt's first ``num_held`` blocks
        (full ones); ``dst_blocks`` are the destinations of the blocks after them.

        Raises (nothing queued): InvalidRequestError (prompt, sampling, block ids not distinct
        or outside the peer's pool, wrong block count, slot/generation out of range, bad
        deadline, duplicate id), CapacityError (prompt larger than the whole local pool),
        DrainingError, PrefillError (decode peer not connected).
        """
        c = self.res.loaded.config
        check_request_id(request_id)
        check_seconds("write_deadline_s", write_deadline_s)
        validate_request(token_ids, params, c.max_position, c.vocab_size)
        if not 0 <= slot < MAX_SLOTS or not 0 <= generation < GENERATION_MODULUS:
            raise InvalidRequestError(f"slot {slot} / generation {generation} out of range")
        peer = self.peers.get(decode_worker_id)
        if peer is None:
            raise PrefillError(f"not connected to decode worker {decode_worker_id!r}")
        need = blocks_needed(len(token_ids), self.res.pool.block_size)
        if not 0 <= num_held <= len(token_ids) // self.res.pool.block_size:
            raise InvalidRequestError(f"num_held_blocks {num_held} is more than the prompt's full blocks")
        if len(dst_blocks) != need - num_held:
            raise InvalidRequestError(f"{len(dst_blocks)} destination blocks for a prompt needing {need} "
                                      f"of which the decode worker holds {num_held}")
        if len(set(dst_blocks)) != len(dst_blocks):
            raise InvalidRequestError("destination block ids are not distinct")
        if any(not 0 <= b < peer.layout.num_blocks for b in dst_blocks):
            raise InvalidRequestError(f"destination block ids outside the decode pool [0, {peer.layout.num_blocks})")
        if need > self.res.pool.num_blocks:
            raise CapacityError(f"prompt needs {need} blocks; the prefill pool holds {self.res.pool.num_blocks}")
        lease = self.res.config.prefill_timeout_s
        if write_deadline_s > 0:
            lease = min(lease, write_deadline_s)
        job = PrefillJob(request_id, list(token_ids), params, peer, list(dst_blocks), slot, generation,
                         time.monotonic() + lease, num_held=num_held)
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
        c = self.res.loaded.config
        check_request_id(request_id)
        validate_request(token_ids, SamplingParams(max_tokens=1), c.max_position, c.vocab_size)
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

    def load(self) -> "PrefillLoad":
        with self._lock:
            queued = sum(len(j.token_ids) - j.num_computed for j in self._queue)
            return PrefillLoad(self.res.pool.allocator.num_free, self.res.pool.num_blocks, len(self._jobs),
                               queued, self._draining)

    def drain(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        with self._lock:
            self._draining = True
            dropped = self._warmups.drop(running=False, why="the worker is draining")
        for job in dropped:
            self._sending.put(job)
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
            self._sending.put(job)
        self._sending.put(None)
        self._sender.join(timeout=30)
        for w in self.watches:
            w.stopped()

    # -- retirement ---------------------------------------------------------------------------------
    def _retire(self, job: PrefillJob) -> None:
        """Free the job's source blocks, account it, finish it (its writes are all complete)."""
        with self._lock:
            if job.src_blocks:
                self.res.pool.allocator.free(job.src_blocks)
                job.src_blocks = []
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

    def _send_loop(self) -> None:
        watch = self.watches[1]
        while (job := self._sending.get()) is not None:
            watch.tick()
            with watch.guard(f"completing {job.request_id}"):
                t0 = time.monotonic()
                for h in job.handles:
                    left = job.deadline + _TRANSFER_GRACE_S - time.monotonic()
                    try:
                        self.res.transfer.wait(h, timeout_s=max(0.1, left))
                    except KVTransferError as exc:
                        job.fail(exc)
                job.transfer_seconds = time.monotonic() - t0
            with watch.guard(f"retiring {job.request_id}"):
                self._retire(job)

    # -- the loop ------------------------------------------------------------------------------------
    def _expire_queued(self) -> list[PrefillJob]:
        now = time.monotonic()
        expired = [j for j in self._queue if now >= j.deadline]
        for job in expired:
            self._queue.remove(job)
            job.fail(PrefillTimeout(f"prefill of {job.request_id} waited past its lease"))
        return expired

    def _schedule(self) -> list[tuple[PrefillJob, SeqChunk]]:
        """The next pass: queued prompts by response ratio up to the pass budget
        (`engine.scheduling`), else a warm-up chunk."""
        for job in [j for j in self._queue if j.stopped]:   # aborted or failed between passes:
            self._queue.remove(job)                         # retire it, compute no more
            self._sending.put(job)
        budget = PassBudget(self.res.config.max_num_batched_tokens, self._batch_tokens)
        batch = []
        remaining = {j.request_id: self._remaining(j) for j in self._queue}   # one cache lookup each
        for job in by_response_ratio(self._queue, time.monotonic(), self._rate.tokens_per_s,
                                     lambda j: j.queued_at, lambda j: remaining[j.request_id]):
            take = budget.take(remaining[job.request_id])   # an estimate until the job holds blocks
            if not take:
                break
            if not job.src_blocks:
                if not self._take_blocks(job):
                    break   # no room for the first in line: nobody overtakes it for blocks
                job.move(JobState.COMPUTING)
            end = job.num_computed + min(take, len(job.token_ids) - job.num_computed)
            last = end == len(job.token_ids)
            batch.append((job, SeqChunk(job.token_ids[job.num_computed:end], job.num_computed,
                                        job.src_blocks, need_logits=last,
                                        prompt_logits=job.params.prompt_logprobs is not None)))
            if not last:
                break
        if not self._queue:
            batch += self._warmups.next_chunk(self.res.config.warmup_chunk_tokens, self._take_blocks,
                                              self._sending.put)
        return batch

    def _remaining(self, job: PrefillJob) -> int:
        """Prompt tokens ``job`` still computes; before it has blocks, less its cached prefix now."""
        if job.src_blocks:
            return len(job.token_ids) - job.num_computed
        hashes = self._hashes(job)
        hit = self.res.pool.allocator.cached_prefix_blocks(hashes) if hashes else 0
        return max(1, len(job.token_ids) - hit * self.res.pool.block_size)

    def _hashes(self, job: PrefillJob) -> list:
        """The job's full-block hashes for the prefix cache (computed once; none when caching is
        off, for prompt logprobs, which need every position's logits, and for the last token,
        which is always computed)."""
        if (self.res.config.prefix_caching and job.params.prompt_logprobs is None and not job.block_hashes
                and not job.warm):
            job.block_hashes = block_hashes(job.token_ids[:len(job.token_ids) - 1], self.res.pool.block_size)
        return job.block_hashes

    def _take_blocks(self, job: PrefillJob) -> bool:
        """Give ``job`` its local blocks: with prefix caching, the cached blocks of its longest
        cached prefix (not computed again; at least the last token is) and fresh ones for the
        rest. False (nothing taken) when the pool cannot hold it now."""
        alloc, bs = self.res.pool.allocator, self.res.pool.block_size
        taken = alloc.allocate_after_prefix(self._hashes(job), blocks_needed(len(job.token_ids), bs))
        if taken is None:
            return False
        job.src_blocks, hit = taken
        job.num_registered = hit
        job.num_computed = job.prefix_hit_tokens = hit * bs
        if not job.warm:
            self.metrics["prefix_hit_tokens"] += hit * bs
        return True

    def _register_full_blocks(self, job: PrefillJob) -> None:
        """Prefix caching: register the job's blocks whose positions are all computed."""
        full = min(job.num_computed // self.res.pool.block_size, len(job.block_hashes))
        for i in range(job.num_registered, full):
            self.res.pool.allocator.register(job.src_blocks[i], job.block_hashes[i])
        job.num_registered = max(job.num_registered, full)

    def _loop(self) -> None:
        watch = self.watches[0]
        while not self._stop.is_set():
            watch.tick()
            batch: list = []
            with watch.guard("scheduling"):
                with self._lock:
                    for job in self._expire_queued():
                        self._sending.put(job)   # no handles: retired at once, off this lock
                    batch = self._schedule()
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
                    self._sending.put(job)

    def _yield_to_prefills(self, layer: int) -> None:
        """A warm-up pass's layer callback: raise `Preempted` once a prefill is queued (read
        without the lock: a stale answer costs one layer)."""
        if self._queue:
            raise Preempted(f"a prefill arrived at layer {layer}")

    def _post_layer(self, layer: int, finishing: list[PrefillJob]) -> None:
        """Post this layer's writes of every finishing job; a job's failure stops it alone."""
        if self.res.pool.kv.is_cuda:  # the layer's K/V must be in memory before the NIC reads them
            torch.cuda.current_stream().synchronize()
        now = time.monotonic()
        for job in finishing:
            if job.stopped:
                continue
            if now >= job.deadline:
                job.fail(PrefillTimeout(f"prefill of {job.request_id} passed its lease while computing"))
                continue
            try:
                plan = plan_writes(self.res.layout, job.peer.layout, job.src_blocks[job.num_held:], job.dst_blocks,
                                   self.res.config.max_write_bytes, layers=[layer])
                ops = to_write_ops(plan, self.res.region, job.peer.remote_key,
                                   pack_immediate(job.slot, job.generation))
                if ops:   # the decode worker may hold every block already
                    job.handles.append(self.res.transfer.post_writes(job.peer.peer, ops))
            except (KVTransferError, ValueError) as exc:
                job.fail(exc)
                continue
            job.bytes_posted += sum(op.length for op in ops)

    def _run(self, batch: list[tuple[PrefillJob, SeqChunk]]) -> None:
        t0 = time.monotonic()
        fb = ForwardBatch.build([c for _, c in batch], self.res.pool.block_size)
        finishing = [job for job, chunk in batch if chunk.need_logits]
        on_layer = (lambda layer: self._post_layer(layer, finishing)) if finishing else None
        if all(job.warm for job, _ in batch):   # a warm-up pass (never batched with prefills)
            on_layer = self._yield_to_prefills
        logits = self.res.loaded.model.forward(fb, self.res.pool, on_layer_done=on_layer)
        for (job, chunk), (first, count) in zip(batch, fb.logits_spans):
            if chunk.prompt_logits:
                job.prompt_logprobs += prompt_logprobs_of(logits[first:first + count], job.token_ids,
                                                          chunk.start, job.params.prompt_logprobs)
        logits = fb.sampling_logits(logits)
        rows, index = [], []
        for i, j in enumerate(finishing):   # n > 1: one row per choice, on the same logits
            for c in range(j.params.n):
                p = child_params(j.params, c) if j.params.n > 1 else j.params
                rows.append(Row(p, p.make_generator(), j.token_ids, stop_token_ids=frozenset(p.stop_token_ids),
                                matcher=j.matcher))   # read only here: the choices share it
                index.append(i)
        if len(index) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
        drawn = sample(logits, rows)
        drawn_lps = compute_logprobs(logits, rows, drawn)
        tokens, logprobs, choices = [], [], []
        at = 0
        for j in finishing:
            got = drawn[at:at + j.params.n]
            bad = next((t for t in got if isinstance(t, SamplingError)), None)
            tokens.append(bad if bad is not None else got[0])
            logprobs.append(drawn_lps[at])
            choices.append((got, drawn_lps[at:at + j.params.n]) if j.params.n > 1 else None)
            at += j.params.n
        elapsed = time.monotonic() - t0
        self._rate.add(sum(len(c.token_ids) for _, c in batch), elapsed)
        with self._lock:
            for job, chunk in batch:
                job.num_computed += len(chunk.token_ids)
                job.compute_seconds += elapsed
                if self.res.config.prefix_caching and not job.stopped:
                    self._register_full_blocks(job)
                if job.warm:
                    self.metrics["warmup_tokens_computed"] += len(chunk.token_ids)
                    if self._warmups.chunk_done(job):
                        self._sending.put(job)
            for job, token, lp, choice in zip(finishing, tokens, logprobs, choices):
                if isinstance(token, SamplingError):
                    job.fail(PrefillError(f"sampling the first token failed: {token}"))
                else:
                    job.first_token, job.first_logprobs = token, lp
                    if choice is not None:
                        job.first_tokens = list(choice[0])
                        job.first_tokens_logprobs = [x for x in choice[1] if x is not None]
                if not job.stopped:
                    job.num_writes = count_writes(self.res.layout, job.peer.layout, job.src_blocks[job.num_held:],
                                                  job.dst_blocks, self.res.config.max_write_bytes)
                    job.bytes_skipped = job.num_held * self.res.layout.bytes_per_block
                self.metrics["kv_bytes_sent"] += job.bytes_posted
                self.metrics["kv_bytes_skipped"] += job.bytes_skipped
                self.metrics["prompt_tokens"] += len(job.token_ids)
                if job in self._queue:
                    self._queue.remove(job)
                job.move(JobState.TRANSFERRING)
        for job in finishing:
            self._sending.put(job)
