"""The prefill worker's KV sender: its decode peers, each layer's writes, and their completion.

Lifecycle of a job's writes: the ``prefill-loop`` thread calls `KVSender.post_layer` as each layer
of the pass holding a prompt's last chunk finishes (the writes of that layer's K and V for every
block the decode worker does not hold, planned by `kvtransfer.plan_writes`, each carrying the
immediate (slot, generation)); then `KVSender.finish` hands the job to the ``prefill-sender``
thread, which waits for every posted write to complete (or fail) and calls the worker's
``retire(job)``: only then may the job's source blocks be reused. A job that posted nothing
(queued, aborted, failed) goes through the same thread, so retirement always happens off the
worker's lock and in one place.

A write that fails fails its job alone; a peer that cannot be planned against fails the jobs bound
for it alone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from kvtransfer import (EndpointInfo, KVLayout, KVTransferError, TransferError, count_writes, pack_immediate,
                        plan_writes, to_write_ops)
from prefill.job import DecodePeer, PrefillJob
from worker.errors import PrefillTimeout
from worker.liveness import LoopWatch
from worker.runtime import WorkerResources

TRANSFER_GRACE_S = 10.0   # how long past its lease the sender waits for a job's posted writes


class KVSender:
    """Decode peers and the ``prefill-sender`` thread over the worker's transfer engine.

    Args:
        res: the worker's resources (pool layout, registered region, transfer engine).
        retire: called from the sender thread with each finished job, its writes all complete.
    """

    def __init__(self, res: WorkerResources, retire: Callable[[PrefillJob], None]):
        self.res = res
        self.peers: dict[str, DecodePeer] = {}
        self._retire = retire
        self._queue: queue.SimpleQueue[PrefillJob | None] = queue.SimpleQueue()
        self.watch = LoopWatch("prefill-sender", stall_s=float("inf"))
        self._thread = threading.Thread(target=self._loop, name="prefill-sender", daemon=True)
        self.watch.attach(self._thread)
        self._thread.start()

    # -- peers --------------------------------------------------------------------------------
    def connect(self, decode_worker_id: str, info: EndpointInfo) -> None:
        """Connect the data plane to a decode worker described by ``info``.
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

    # -- writes -------------------------------------------------------------------------------
    def post_layer(self, layer: int, jobs: list[PrefillJob]) -> None:
        """Post ``layer``'s writes of each job; a job past its lease, or whose plan or post
        fails, fails alone and posts no more."""
        if self.res.pool.kv.is_cuda:  # the layer's K/V must be in memory before the NIC reads them
            torch.cuda.current_stream().synchronize()
        now = time.monotonic()
        for job in jobs:
            if job.stopped:
                continue
            if now >= job.deadline:
                job.fail(PrefillTimeout(f"prefill of {job.request_id} passed its lease while computing"))
                continue
            try:
                plan = plan_writes(self.res.layout, job.peer.layout, job.block_table[job.num_held_blocks:],
                                   job.dst_blocks, self.res.config.max_write_bytes, layers=[layer])
                ops = to_write_ops(plan, self.res.region, job.peer.remote_key,
                                   pack_immediate(job.slot, job.generation))
                if ops:   # the decode worker may hold every block already
                    job.handles.append(self.res.transfer.post_writes(job.peer.peer, ops))
            except (KVTransferError, ValueError) as exc:
                job.fail(exc)
                continue
            job.bytes_posted += sum(op.length for op in ops)

    def count(self, job: PrefillJob) -> None:
        """Set ``job.num_writes`` (the plan's count over every layer: the immediates the decode
        worker counts) and ``job.bytes_skipped`` (the blocks the decode worker holds)."""
        job.num_writes = count_writes(self.res.layout, job.peer.layout, job.block_table[job.num_held_blocks:],
                                      job.dst_blocks, self.res.config.max_write_bytes)
        job.bytes_skipped = job.num_held_blocks * self.res.layout.bytes_per_block

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
                job.transfer_seconds = time.monotonic() - t0
            with self.watch.guard(f"retiring {job.request_id}"):
                self._retire(job)
