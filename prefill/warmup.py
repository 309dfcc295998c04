"""Prefix-cache warm-ups of the prefill worker: the queue and its rules.

The router hands back a finished request's prompt + output (`PrefillWorker.warm`) so the next
turn of the conversation finds its previous answer cached on the prefill worker, not only on the
decode worker that decoded it. A warm-up computes the full blocks the cache lacks into it and
writes nothing to any peer. It runs only when no prefill is queued, ``warmup_chunk_tokens`` at a
time, and a pass of it stops between two layers as soon as a prefill is queued (`Preempted`: the
pass's K/V went into the warm-up's own unregistered blocks and is computed again later), so a
prefill waits for one layer of it at most. It is dropped, not run, when it would leave less than
`POOL_SHARE` of the pool free, when its own lease passes while queued, and when the worker
drains or stops.

`WarmupQueue` is not thread-safe: the prefill worker's lock guards it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from engine.attention import SeqChunk
from engine.block_hash import block_hashes
from engine.errors import CapacityError
from engine.kv_cache import KVPool
from engine.sampling import SamplingParams
from prefill.job import JobState, PrefillJob
from worker.errors import WarmupDropped

MAX_QUEUED = 64    # warm-ups queued at most (more: CapacityError, RESOURCE_EXHAUSTED on the wire)
POOL_SHARE = 0.5   # a warm-up runs only if the pool keeps this share free for prefills


class Preempted(Exception):
    """A warm-up pass stopped between layers because a prefill was queued."""


class WarmupQueue:
    """Warm-up jobs, oldest first, over the worker's ``pool``; each job's lease is ``lease_s``."""

    def __init__(self, pool: KVPool, lease_s: float):
        self.pool = pool
        self.lease_s = lease_s
        self._jobs: deque[PrefillJob] = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job: PrefillJob) -> bool:
        return job in self._jobs

    def add(self, request_id: str, token_ids: list[int]) -> PrefillJob:
        """Queue a warm-up of the full blocks of ``token_ids`` (checked by the caller); returns its
        job. Raises CapacityError when `MAX_QUEUED` are queued (nothing queued)."""
        if len(self._jobs) >= MAX_QUEUED:
            raise CapacityError(f"{MAX_QUEUED} warm-ups are queued already")
        bs = self.pool.block_size
        full = len(token_ids) // bs * bs
        job = PrefillJob(request_id, list(token_ids[:full]), SamplingParams(max_tokens=1), None, [], 0, 0,
                         time.monotonic() + self.lease_s, warm=True)
        job.block_hashes = block_hashes(job.prompt_token_ids, bs)
        self._jobs.append(job)
        return job

    def next_chunk(self, budget: int, take_blocks: Callable[[PrefillJob], bool],
                   retire: Callable[[PrefillJob], None]) -> list[tuple[PrefillJob, SeqChunk]]:
        """The next chunk (at most ``budget`` tokens) of the oldest warm-up, as a one-chunk pass;
        warm-ups found cached whole finish here, those that cannot run are dropped; both are
        handed to ``retire`` (blocks freed off the caller's lock). ``take_blocks(job)`` gives a
        job its blocks and moves it to COMPUTING (False: no room, nothing taken)."""
        alloc = self.pool.allocator
        while self._jobs:
            job = self._jobs[0]
            if not job.block_table:
                if time.monotonic() >= job.deadline or (
                        alloc.num_free - len(job.block_hashes) < POOL_SHARE * self.pool.num_blocks):
                    job.fail(WarmupDropped(f"warm-up {job.request_id} dropped: the pool needs its room"))
                elif not take_blocks(job):
                    job.fail(WarmupDropped(f"warm-up {job.request_id} dropped: no room in the pool"))
            if job.stopped or job.num_computed == len(job.prompt_token_ids):   # dropped, or cached whole
                self._jobs.popleft()
                if job.state == JobState.COMPUTING:
                    job.move(JobState.TRANSFERRING)
                retire(job)
                continue
            end = min(len(job.prompt_token_ids), job.num_computed + budget)
            return [(job, SeqChunk(job.prompt_token_ids[job.num_computed:end], job.num_computed, job.block_table,
                                   need_logits=False))]
        return []

    def expire(self) -> list[PrefillJob]:
        """Drop the warm-ups not started whose lease has passed, while none may run (the worker
        defers them: `prefill.worker`); returns them, failed with `WarmupDropped`, to be retired
        as `next_chunk`'s are."""
        now = time.monotonic()
        gone = [job for job in self._jobs if not job.block_table and now >= job.deadline]
        for job in gone:
            self._jobs.remove(job)
            job.fail(WarmupDropped(f"warm-up {job.request_id} dropped: its lease passed while deferred"))
        return gone

    def chunk_done(self, job: PrefillJob) -> bool:
        """After a pass of ``job`` counted its tokens: True (and the job leaves the queue, moved
        to TRANSFERRING, to be retired) when it has computed everything."""
        if job.num_computed == len(job.prompt_token_ids) and self._jobs and self._jobs[0] is job:
            self._jobs.popleft()
            job.move(JobState.TRANSFERRING)
            return True
        return False

    def remove(self, job: PrefillJob) -> None:
        """Forget ``job`` (its pass failed; the caller fails and retires it)."""
        if job in self._jobs:
            self._jobs.remove(job)

    def drop(self, running: bool, why: str) -> list[PrefillJob]:
        """Drop the queued warm-ups (and the one computing when ``running``: only once the loop
        thread stopped) with `WarmupDropped` (``why``); returns them, to be retired."""
        keep = [j for j in self._jobs if j.block_table and not running]
        dropped = [j for j in self._jobs if j not in keep]
        self._jobs = deque(keep)
        for job in dropped:
            job.fail(WarmupDropped(f"warm-up {job.request_id} dropped: {why}"))
            if job.state == JobState.COMPUTING:
                job.move(JobState.TRANSFERRING)
        return dropped
