"""The prefill worker's core: batch waiting prompts, chunk long ones, post KV writes layer by layer.

Lifecycle of a job:

    submit      QUEUED: waits for source blocks (the local pool) and a place in a batch
    compute     COMPUTING: the ``prefill-loop`` thread runs forward passes; a prompt longer than
                ``max_num_batched_tokens`` takes several passes (chunks). In the pass that holds
                the prompt's LAST chunk, as each layer finishes, the writes of that layer (K and V
                of every block, planned by `kvtransfer.plan_writes`, each carrying the immediate
                (slot, generation)) are posted to the decode worker. The first token is sampled.
    transfer    TRANSFERRING: the submitting thread waits for every posted write to complete
    done        DONE / FAILED / ABORTED: the source blocks are freed only now, after every posted
                write completed or failed (the engine no longer reads them).

``num_writes`` is the count of the deterministic plan over all layers, so it equals the number of
immediates the decode worker will count. Every job has a lease (``prefill_timeout_s``): past it
the job fails with `PrefillTimeout`. An aborted job stops posting at the next layer; `abort`
returns once its posted writes completed, which is the "abort acknowledged" the decode side's
block-reuse rule relies on.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.errors import CapacityError, InvalidRequestError
from engine.generator import validate_request
from engine.ids import BlockId
from engine.kv_cache import blocks_needed
from engine.sampling import SamplingParams, sample
from kvtransfer import (KVLayout, KVTransferError, PeerId, TransferError, WriteHandle, count_writes,
                        pack_immediate, plan_writes, to_write_ops)
from worker.runtime import WorkerResources

log = logging.getLogger(__name__)


class PrefillError(Exception):
    """A prefill job could not complete (the message says why)."""


class PrefillTimeout(PrefillError):
    """The job's lease expired."""


class PrefillAborted(PrefillError):
    """The job was aborted."""


class JobState(enum.IntEnum):
    QUEUED = 0
    COMPUTING = 1
    TRANSFERRING = 2
    DONE = 3
    FAILED = 4


@dataclass(frozen=True)
class DecodePeer:
    """A connected decode worker: engine peer id, its pool layout and region key."""

    peer: PeerId
    layout: KVLayout
    remote_key: int


@dataclass
class PrefillJob:
    """One request's prefill + KV transfer."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    peer: DecodePeer
    dst_blocks: list[int]
    slot: int
    generation: int
    deadline: float
    state: JobState = JobState.QUEUED
    src_blocks: list[BlockId] = field(default_factory=list)
    num_computed: int = 0
    first_token: int | None = None
    num_writes: int = 0
    bytes_posted: int = 0
    handles: list[WriteHandle] = field(default_factory=list)
    aborted: bool = False
    error: Exception | None = None
    computed: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    compute_seconds: float = 0.0
    transfer_seconds: float = 0.0


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    num_writes: int
    bytes_written: int
    compute_seconds: float
    transfer_seconds: float


class PrefillWorker:
    """Prefill scheduler + KV sender over the worker's resources."""

    def __init__(self, res: WorkerResources):
        self.res = res
        self.peers: dict[str, DecodePeer] = {}
        self._lock = threading.Condition()
        self._queue: deque[PrefillJob] = deque()
        self._jobs: dict[str, PrefillJob] = {}
        self._draining = False
        self._stop = threading.Event()
        self.metrics = {"prefills_completed": 0, "prefills_failed": 0, "prefills_aborted": 0,
                        "kv_bytes_sent": 0, "kv_writes_posted": 0, "prompt_tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)
        self._thread.start()

    # -- peers ------------------------------------------------------------------------------------
    def connect(self, decode_worker_id: str, info) -> None:
        """Connect the data plane to a decode worker described by ``info`` (`EndpointInfo`)."""
        if not info.regions:
            raise TransferError(f"decode worker {decode_worker_id} registered no memory")
        region = info.regions[0]
        local = self.res.layout
        per_block = local.num_layers * 2 * local.block_bytes
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
    def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams, decode_worker_id: str,
                dst_blocks: list[int], slot: int, generation: int) -> PrefillResult:
        """Run one job to completion (blocks the caller). Raises InvalidRequestError, PrefillError,
        CapacityError (prompt larger than the whole local pool), KVTransferError."""
        job = self._submit(request_id, token_ids, params, decode_worker_id, dst_blocks, slot, generation)
        try:
            if not job.computed.wait(max(0.0, job.deadline - time.monotonic())):
                self._abort_job(job, PrefillTimeout(f"prefill of {request_id} exceeded its lease"))
                job.computed.wait()
            self._wait_transfer(job)
            if job.error is not None:
                raise job.error
            return PrefillResult(job.first_token, job.num_writes, job.bytes_posted, job.compute_seconds,
                                 job.transfer_seconds)
        finally:
            self._retire(job)

    def _submit(self, request_id, token_ids, params, decode_worker_id, dst_blocks, slot, generation) -> PrefillJob:
        c = self.res.loaded.config
        validate_request(token_ids, params, c.max_position, c.vocab_size)
        peer = self.peers.get(decode_worker_id)
        if peer is None:
            raise InvalidRequestError(f"not connected to decode worker {decode_worker_id!r}")
        need = blocks_needed(len(token_ids), self.res.pool.block_size)
        if len(dst_blocks) != need:
            raise InvalidRequestError(f"{len(dst_blocks)} destination blocks for a prompt needing {need}")
        if need > self.res.pool.num_blocks:
            raise CapacityError(f"prompt needs {need} blocks; the prefill pool holds {self.res.pool.num_blocks}")
        job = PrefillJob(request_id, list(token_ids), params, peer, list(dst_blocks), slot, generation,
                         time.monotonic() + self.res.config.prefill_timeout_s)
        with self._lock:
            if self._draining:
                raise PrefillError("prefill worker is draining")
            if request_id in self._jobs:
                raise InvalidRequestError(f"request {request_id!r} is already being prefilled")
            self._jobs[request_id] = job
            self._queue.append(job)
            self._lock.notify_all()
        return job

    def _wait_transfer(self, job: PrefillJob) -> None:
        t0 = time.monotonic()
        for h in job.handles:
            try:
                self.res.transfer.wait(h, timeout_s=max(0.1, job.deadline - time.monotonic()))
            except KVTransferError as exc:
                if job.error is None:
                    job.error = exc
        job.transfer_seconds = time.monotonic() - t0

    def _retire(self, job: PrefillJob) -> None:
        with self._lock:
            if job.src_blocks:
                self.res.pool.allocator.free(job.src_blocks)
                job.src_blocks = []
            job.state = JobState.FAILED if job.error else JobState.DONE
            self._jobs.pop(job.request_id, None)
            key = "prefills_failed" if job.error and not job.aborted else (
                "prefills_aborted" if job.aborted else "prefills_completed")
            self.metrics[key] += 1
            job.finished.set()
            self._lock.notify_all()

    def abort(self, request_id: str, timeout_s: float = 30.0) -> bool:
        """Abort a job; returns once its posted writes completed (False if unknown)."""
        with self._lock:
            job = self._jobs.get(request_id)
        if job is None:
            return False
        self._abort_job(job, PrefillAborted(f"request {request_id} aborted"))
        job.finished.wait(timeout_s)
        return True

    def _abort_job(self, job: PrefillJob, error: PrefillError) -> None:
        with self._lock:
            job.aborted = True
            if job.error is None:
                job.error = error
            if job.state == JobState.QUEUED and job in self._queue:
                self._queue.remove(job)
                job.computed.set()

    def load(self) -> tuple[int, int, int, int, bool]:
        """(free_blocks, total_blocks, queued jobs, queued prompt tokens, draining)."""
        with self._lock:
            queued = sum(len(j.token_ids) - j.num_computed for j in self._queue)
            return (self.res.pool.allocator.num_free, self.res.pool.num_blocks, len(self._jobs), queued,
                    self._draining)

    def drain(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        with self._lock:
            self._draining = True
            while self._jobs and time.monotonic() < end:
                self._lock.wait(0.2)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for job in list(self._queue):
                job.error = job.error or PrefillError("prefill worker closed")
                job.computed.set()
            self._queue.clear()
            self._lock.notify_all()
        self._thread.join(timeout=30)

    # -- the loop ------------------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[PrefillJob, SeqChunk]]:
        budget = self.res.config.max_num_batched_tokens
        batch = []
        for job in list(self._queue):
            if budget <= 0:
                break
            if not job.src_blocks:
                need = blocks_needed(len(job.token_ids), self.res.pool.block_size)
                if not self.res.pool.allocator.can_allocate(need):
                    break
                job.src_blocks = self.res.pool.allocator.allocate(need)
                job.state = JobState.COMPUTING
            take = min(len(job.token_ids) - job.num_computed, budget)
            end = job.num_computed + take
            last = end == len(job.token_ids)
            batch.append((job, SeqChunk(job.token_ids[job.num_computed:end], job.num_computed,
                                        job.src_blocks, need_logits=last)))
            budget -= take
            if not last:
                break
        return batch

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                for job in [j for j in self._queue if now >= j.deadline]:
                    self._queue.remove(job)
                    job.error = job.error or PrefillTimeout(f"prefill of {job.request_id} exceeded its lease")
                    job.computed.set()
                batch = self._schedule()
                if not batch:
                    self._lock.wait(0.25)
                    continue
            try:
                self._run(batch)
            except Exception as exc:  # fail the batch's jobs, keep serving
                log.exception("prefill pass failed")
                for job, _ in batch:
                    job.error = job.error or PrefillError(f"prefill failed: {exc}")
                    with self._lock:
                        if job in self._queue:
                            self._queue.remove(job)
                    job.computed.set()

    def _run(self, batch: list[tuple[PrefillJob, SeqChunk]]) -> None:
        t0 = time.monotonic()
        fb = ForwardBatch.build([c for _, c in batch], self.res.pool.block_size)
        finishing = [job for job, chunk in batch if chunk.need_logits]

        on_gpu = self.res.pool.kv.is_cuda

        def post_layer(layer: int) -> None:
            if on_gpu:  # the layer's K/V must be in memory before the NIC reads them
                torch.cuda.current_stream().synchronize()
            for job in finishing:
                if job.aborted:
                    continue
                plan = plan_writes(self.res.layout, job.peer.layout, job.src_blocks, job.dst_blocks,
                                   self.res.config.max_write_bytes, layers=[layer])
                ops = to_write_ops(plan, self.res.region, job.peer.remote_key,
                                   pack_immediate(job.slot, job.generation))
                try:
                    job.handles.append(self.res.transfer.post_writes(job.peer.peer, ops))
                except KVTransferError as exc:
                    job.error = job.error or exc
                    job.aborted = True
                    continue
                job.bytes_posted += sum(op.length for op in ops)

        logits = self.res.loaded.model.forward(fb, self.res.pool, on_layer_done=post_layer if finishing else None)
        tokens = sample(logits, [j.params for j in finishing], [j.params.make_generator() for j in finishing])
        elapsed = time.monotonic() - t0
        with self._lock:
            for job, chunk in batch:
                job.num_computed += len(chunk.token_ids)
                job.compute_seconds += elapsed
            for job, token in zip(finishing, tokens):
                job.first_token = token
                job.num_writes = count_writes(self.res.layout, job.peer.layout, job.src_blocks, job.dst_blocks,
                                              self.res.config.max_write_bytes)
                self.metrics["kv_bytes_sent"] += job.bytes_posted
                self.metrics["prompt_tokens"] += len(job.token_ids)
                job.state = JobState.TRANSFERRING
                if job in self._queue:
                    self._queue.remove(job)
                job.computed.set()
