"""gRPC `Prefill` service (``grpc.aio``) over a `PrefillWorker`; the contract of each RPC is in
rpc/pdserve.proto, the exception -> status table in `worker.grpc_status`.

A Prefill call is a coroutine awaiting its job's done callback (no thread waits for compute or
transfer); a call cancelled by its caller aborts the job. Abort answers once the job's posted
writes completed (the acknowledgement the decode side's block-reuse rule needs), or
DEADLINE_EXCEEDED when they did not within ``abort_timeout_s``: then no stop is acknowledged.
"""

from __future__ import annotations

import asyncio
import logging

from kvtransfer.group import GroupEndpoint
from prefill.job import wait_finished
from prefill.worker import PrefillWorker
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.convert import logprobs_to_proto, sampling_from_proto
from worker.errors import PrefillTimeout
from worker.grpc_status import unary
from worker.liveness import check
from worker.runtime import WorkerResources

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillServicer):
    """The prefill worker's RPC surface."""

    def __init__(self, res: WorkerResources, worker: PrefillWorker, abort_timeout_s: float = 30.0):
        self.res = res
        self.worker = worker
        self.abort_timeout_s = abort_timeout_s

    def add_to_server(self, server) -> None:
        pb_grpc.add_PrefillServicer_to_server(self, server)

    def _endpoint(self) -> pb.Endpoint:
        return pb.Endpoint(engine=self.res.transfer.name, description=self.res.endpoint().to_bytes())

    @unary
    async def Describe(self, request, context):
        return self._endpoint()

    @unary
    async def Connect(self, request, context):
        info = GroupEndpoint.from_bytes(request.peer_endpoint.description)
        await asyncio.get_running_loop().run_in_executor(None, self.worker.connect, request.peer_worker_id, info)
        return pb.ConnectResponse(endpoint=self._endpoint())

    @unary
    async def Disconnect(self, request, context):
        await asyncio.get_running_loop().run_in_executor(None, self.worker.disconnect, request.peer_worker_id)
        return pb.DisconnectResponse()

    @unary
    async def Prefill(self, request, context):
        params = sampling_from_proto(request.sampling)
        job = self.worker.submit(request.request_id, list(request.token_ids), params, request.decode_worker_id,
                                 list(request.block_ids), request.slot, request.generation,
                                 request.write_deadline_s, request.num_held_blocks)
        try:
            await wait_finished(job, None)   # every job finishes: its lease bounds it
        except asyncio.CancelledError:   # the caller gave up (deadline, cancel): stop the job
            self.worker.abort(job.request_id)
            raise
        r = job.result()
        resp = pb.PrefillResponse(first_tokens=r.first_tokens, finish_reasons=r.finish_reasons,
                                  num_writes=r.num_writes, bytes_written=r.bytes_written,
                                  prefill_seconds=r.compute_seconds, transfer_seconds=r.transfer_seconds,
                                  bytes_skipped=r.bytes_skipped, prefix_hit_tokens=r.prefix_hit_tokens)
        resp.first_logprobs.extend(logprobs_to_proto(lp) for lp in r.first_logprobs)
        resp.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in r.prompt_logprobs)
        return resp

    @unary
    async def Warm(self, request, context):
        job = self.worker.warm(request.request_id, list(request.token_ids))
        await wait_finished(job, None)   # it runs or is dropped; a cancelled call leaves it queued
        computed = job.num_computed - job.prefix_hit_tokens if job.error is None else 0
        return pb.WarmResponse(computed_tokens=computed, cached_tokens=job.prefix_hit_tokens,
                               dropped=job.error is not None)

    @unary
    async def Abort(self, request, context):
        job = self.worker.abort(request.request_id)
        if job is None:
            return pb.AbortResponse(found=False)
        if not await wait_finished(job, self.abort_timeout_s):
            raise PrefillTimeout(f"the writes of {request.request_id} did not complete within "
                                 f"{self.abort_timeout_s:g}s of the abort")
        return pb.AbortResponse(found=True)

    @unary
    async def Stats(self, request, context):
        counters = dict(self.worker.metrics)
        counters.update(self.res.pool.allocator.stats, cached_blocks=self.res.pool.allocator.num_cached)
        es = self.res.transfer.stats()
        counters.update(kv_writes_posted=es.writes_posted, kv_bytes_posted=es.bytes_posted,
                        peers_lost=es.peers_lost, loop_errors=sum(w.errors for w in self.worker.watches))
        return pb.StatsResponse(load=self.load(), counters={k: float(v) for k, v in counters.items()})

    @unary
    async def Drain(self, request, context):
        self.worker.drain(0.0)
        return pb.DrainResponse()

    def load(self) -> pb.LoadStats:
        p = self.worker.load()
        problem = check(self.worker.watches)
        return pb.LoadStats(free_blocks=p.free_blocks, total_blocks=p.total_blocks, waiting=p.jobs,
                            queued_prompt_tokens=p.queued_prompt_tokens, draining=p.draining,
                            unhealthy=problem is not None, unhealthy_reason=problem or "")

    def drain(self, timeout_s: float) -> None:
        self.worker.drain(timeout_s)

    def close(self) -> None:
        self.worker.close()
