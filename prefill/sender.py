"""The prefill worker's KV sender: its decode peers, each layer's writes, and their completion.

Lifecycle of a job's writes: the ``prefill-loop`` thread calls `KVSender.post_layers` for the pass
holding a prompt's last chunk (the writes of K and V for every block the decode worker does not
hold, planned by `kvtransfer.plan_writes`, each carrying the immediate (slot, generation)): as each
layer finishes, or for every layer once the pass ends (``per_layer``, from
`worker.config.WorkerConfig.kv_send`); then `KVSender.finish` hands the job to the ``prefill-sender``
thread, which waits for every posted write to complete (or fail) and calls the worker's
``retire(job)``: only then may the job's source blocks be reused. A job that posted nothing
(queued, aborted, failed) goes through the same thread, so retirement always happens off the
worker's lock and in one place.

A write that fails fails its job alone; a peer that cannot be planned against fails the jobs bound
for it alone.

Tensor parallel (`worker.tp_rank`): every rank writes its own KV heads from its own pool. Rank 0
posts its routes' writes here; the pass carries each finishing job's `JobWrites` to the other ranks
(`rank_work`), which post theirs at the same points and report each job's completion; the sender
thread retires a job once rank 0's writes and every other rank's report are in (or the group is
lost: then no rank writes any more).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvtransfer import KVTransferError, TransferError, pack_immediate
from kvtransfer.group import GroupEndpoint
from prefill.job import PrefillJob
from worker.errors import PrefillTimeout
from worker.liveness import LoopWatch
from worker.runtime import WorkerResources
from worker.tp_rank import (DecodePeer, JobWrites, PassWrites, connect_group, count_job_writes, disconnect_group,
                            post_layers)

TRANSFER_GRACE_S = 10.0   # how long past its lease the sender waits for a job's posted writes


class KVSender:
    """Decode peers and the ``prefill-sender`` thread over the worker's transfer engine.

    Args:
        res: the worker's resources (pool layout, registered region, transfer engine).
        retire: called from the sender thread with each finished job, its writes all complete.
    """

    def __init__(self, res: WorkerResources, retire: Callable[[PrefillJob], None]):
        self.res = res
        self.per_layer = res.config.kv_send_per_layer
        self.peers: dict[str, DecodePeer] = {}
        self._retire = retire
        self._keys = itertools.count(1)
        self._reports: dict[int, dict[int, tuple[str | None, int]]] = {}   # job key -> rank -> (error, bytes)
        self._reported = threading.Condition()
        res.rank_events["kv_done"] = self._rank_done
        self._queue: queue.SimpleQueue[PrefillJob | None] = queue.SimpleQueue()
        self.watch = LoopWatch("prefill-sender", stall_s=float("inf"))
        self._thread = threading.Thread(target=self._loop, name="prefill-sender", daemon=True)
        self.watch.attach(self._thread)
        self._thread.start()

    # -- peers --------------------------------------------------------------------------------
    def connect(self, decode_worker_id: str, group: GroupEndpoint) -> None:
        """Connect every rank of this worker to the decode worker (group) ``group`` describes: each
        to the decode ranks its routes name (`worker.tp_rank.connect_group`).
        Raises `TransferError` (no region, layout or KV heads mismatch naming both sides,
        unreachable), `AuthError`; a tensor-parallel rank's error as it raised it."""
        self.disconnect(decode_worker_id)
        who = f"decode worker {decode_worker_id}"
        peer = connect_group(self.res.transfer, group, self.res.layout, self.res.loaded.config.num_kv_heads, 0,
                             self.res.tp_size, who)
        if self.res.tp_size > 1:
            try:
                self.res.loaded.model.call("kv_connect", (decode_worker_id, group.to_bytes()))
            except BaseException:
                disconnect_group(self.res.transfer, peer)
                raise
        self.peers[decode_worker_id] = peer

    def disconnect(self, decode_worker_id: str) -> None:
        p = self.peers.pop(decode_worker_id, None)
        if p is not None:
            disconnect_group(self.res.transfer, p)
            if self.res.tp_size > 1 and not self.res.loaded.model.lost:
                self.res.loaded.model.call("kv_disconnect", decode_worker_id)

    # -- writes -------------------------------------------------------------------------------
    def post_layers(self, layers: Sequence[int], jobs: list[PrefillJob]) -> None:
        """Post the writes of ``layers`` (their K/V computed) of each job; a job past its lease,
        or whose plan or post fails, fails alone and posts no more."""
        if self.res.pool.kv.is_cuda:  # the layer's K/V must be in memory before the NIC reads them
            torch.cuda.current_stream().synchronize()
        now = time.monotonic()
        for job in jobs:
            if job.stopped:
                continue
            if now >= job.deadline:
                job.fail(PrefillTimeout(f"prefill of {job.request_id} passed its lease while computing"))
                continue
            try:   # the decode worker may hold every block already: then nothing is posted
                handles, nbytes = post_layers(self.res.transfer, self.res.region, self.res.layout, job.peer,
                                              job.block_table[job.num_held_blocks:], job.dst_blocks,
                                              pack_immediate(job.slot, job.generation),
                                              self.res.config.max_write_bytes, layers)
            except (KVTransferError, ValueError) as exc:
                job.fail(exc)
                continue
            job.handles.extend(handles)
            job.bytes_posted += nbytes

    def rank_work(self, jobs: list[PrefillJob]) -> PassWrites | None:
        """The other ranks' part of a pass finishing ``jobs``: each job's `JobWrites` (its key
        recorded: `_loop` then waits for every rank's report), posted as this rank posts
        (``per_layer``); None at TP 1 or with no job to write."""
        if self.res.tp_size == 1:
            return None
        work = []
        for job in jobs:
            if job.stopped or job.peer is None:
                continue
            job.tp_key = next(self._keys)
            with self._reported:
                self._reports[job.tp_key] = {}
            work.append(JobWrites(job.tp_key, job.peer_id, list(job.block_table[job.num_held_blocks:]),
                                  list(job.dst_blocks), pack_immediate(job.slot, job.generation), job.deadline))
        return PassWrites(work, self.per_layer) if work else None

    def count(self, job: PrefillJob) -> None:
        """Set ``job.num_writes`` (the plan's count over every layer and every rank's routes: the
        immediates the decode worker counts) and ``job.bytes_skipped`` (the blocks the decode
        worker holds)."""
        job.num_writes = count_job_writes(self.res.layout, job.peer, job.block_table[job.num_held_blocks:],
                                          job.dst_blocks, self.res.config.max_write_bytes)
        layout = self.res.layout   # a rank's heads; the model's are what the decode worker holds
        job.bytes_skipped = (job.num_held_blocks * layout.bytes_per_block // layout.num_kv_heads
                             * self.res.loaded.config.num_kv_heads)

    def _rank_done(self, rank: int, key: int, error: str | None, nbytes: int) -> None:
        """A follower rank's report of job ``key`` (its events thread)."""
        with self._reported:
            if key in self._reports:
                self._reports[key][rank] = (error, nbytes)
                self._reported.notify_all()

    def _wait_ranks(self, job: PrefillJob) -> None:
        """Wait for every follower's report of ``job`` (to its lease + grace, or the group's loss)."""
        model = self.res.loaded.model
        with self._reported:
            reports = self._reports[job.tp_key]
            while len(reports) < self.res.tp_size - 1:
                if model.lost is not None:
                    job.fail(TransferError(f"tensor-parallel group lost: {model.lost}"))
                    break
                if time.monotonic() > job.deadline + TRANSFER_GRACE_S:
                    job.fail(TransferError("a tensor-parallel rank did not report its writes"))
                    break
                self._reported.wait(0.05)
            del self._reports[job.tp_key]
        for rank, (error, nbytes) in sorted(reports.items()):
            job.bytes_posted += nbytes
            if error is not None:
                job.fail(TransferError(error))

    def finish(self, job: PrefillJob) -> None:
        """Hand ``job`` (posting nothing more) to the sender thread: it is retired once its
        posted writes completed. Never blocks."""
        self._queue.put(job)

    def close(self) -> None:
        """Retire what was handed over, then stop and join the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.watch.stopped()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self.watch.tick()
            with self.watch.guard(f"completing {job.request_id}"):
                t0 = time.monotonic()
                for h in job.handles:
                    left = job.deadline + TRANSFER_GRACE_S - time.monotonic()
                    try:
                        self.res.transfer.wait(h, timeout_s=max(0.1, left))
                    except KVTransferError as exc:
                        job.fail(exc)
                if job.tp_key is not None:
                    self._wait_ranks(job)
                job.transfer_seconds = time.monotonic() - t0
            with self.watch.guard(f"retiring {job.request_id}"):
                self._retire(job)
