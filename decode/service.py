"""gRPC `Decode` service (``grpc.aio``) over a `DecodeWorker`; the contract of each RPC is in
rpc/pdserve.proto, the exception -> status table in `worker.grpc_status`.

Calls that take the worker's locks run in the server's ``decode-ctl`` executor; streams are
coroutines reading the request's `AsyncSink` (no thread per stream). A stream that ends before
its request finished (the client cancelled, or went away) detaches it (`DecodeWorker.detach`): a
decoding request is aborted, one still waiting for its KV is dropped once the KV is in.
"""

from __future__ import annotations

import asyncio
import logging

from decode.worker import DecodeWorker
from engine.generator import StepOutput
from engine.sequence import FinishReason
from kvtransfer.group import GroupEndpoint
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.async_sink import AsyncSink
from worker.convert import logprobs_to_proto, sampling_from_proto
from worker.grpc_status import stream, unary
from worker.liveness import check
from worker.runtime import WorkerResources

log = logging.getLogger(__name__)


async def _ctl(fn, *args):
    """Run a lock-taking worker call in the server's executor, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class DecodeService(pb_grpc.DecodeServicer):
    """The decode worker's RPC surface."""

    def __init__(self, res: WorkerResources, worker: DecodeWorker):
        self.res = res
        self.worker = worker
        self._peers: dict[str, tuple[str, ...]] = {}  # prefill worker id -> its ranks' endpoint ids

    def add_to_server(self, server) -> None:
        pb_grpc.add_DecodeServicer_to_server(self, server)

    # -- brokering ------------------------------------------------------------------------------
    def _endpoint(self) -> pb.Endpoint:
        return pb.Endpoint(engine=self.res.transfer.name, description=self.res.endpoint().to_bytes())

    @unary
    async def Describe(self, request, context):
        return self._endpoint()

    @unary
    async def Connect(self, request, context):
        # Writers connect to us (tcp/shm); we only remember who they are.
        if request.peer_endpoint.description:
            info = GroupEndpoint.from_bytes(request.peer_endpoint.description)   # KVTransferError
            self._peers[request.peer_worker_id] = tuple(r.endpoint_id for r in info.ranks)
            if len(info.ranks) > 1:   # a tensor-parallel writer: its ranks stand for each other
                self.worker.add_writer_group(self._peers[request.peer_worker_id])
        return pb.ConnectResponse(endpoint=self._endpoint())

    @unary
    async def Disconnect(self, request, context):
        self._peers.pop(request.peer_worker_id, None)
        return pb.DisconnectResponse()

    # -- requests -------------------------------------------------------------------------------
    @unary
    async def Reserve(self, request, context):
        rid = request.request_id
        writers = self._peers.get(request.writer_worker_id, ())   # unknown or empty: none named
        done = asyncio.get_running_loop().run_in_executor(
            None, self.worker.reserve, rid, request.num_prompt_tokens, request.max_tokens,
            list(request.prompt_token_ids), writers)
        try:
            r = await asyncio.shield(done)
        except asyncio.CancelledError:   # the caller is gone: nobody will learn of this reservation
            done.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                   or self.worker.abort(rid, writer_stopped=True))
            raise
        t = r.require_transfer()   # Reserve always acquires one
        return pb.ReserveResponse(block_ids=r.blocks, slot=t.slot, generation=t.generation,
                                  lease_s=self.res.config.transfer_timeout_s, num_held_blocks=r.num_held_blocks)

    @stream
    async def Decode(self, request, context):
        params = sampling_from_proto(request.sampling)
        sink = AsyncSink(asyncio.get_running_loop())
        await _ctl(self.worker.start_decode, request.request_id, list(request.first_tokens), request.num_writes,
                   list(request.prompt_token_ids), params, sink)
        async for chunk in self._stream(request.request_id, sink):
            yield chunk

    @stream
    async def ServeColocated(self, request, context):
        params = sampling_from_proto(request.sampling)
        sink = AsyncSink(asyncio.get_running_loop())
        await _ctl(self.worker.serve_colocated, request.request_id, list(request.prompt_token_ids), params, sink)
        async for chunk in self._stream(request.request_id, sink):
            yield chunk

    async def _stream(self, request_id: str, sink: AsyncSink):
        """Token chunks of one request: every output already queued goes out at once, one chunk
        per choice. Raises the transfer's error; an end before the finish (cancelled) aborts the
        request."""
        finished = False
        try:
            while not finished:
                outputs = [await sink.get()]
                while not isinstance(outputs[-1], Exception) and not outputs[-1].request_finished:
                    try:
                        outputs.append(sink.get_nowait())
                    except asyncio.QueueEmpty:
                        break
                chunks, finished = _chunks(outputs)
                for chunk in chunks:
                    yield chunk
        finally:
            if not finished:   # cancelled, or failed: make sure nothing of it stays
                asyncio.get_running_loop().run_in_executor(None, self.worker.detach, request_id)

    @unary
    async def Abort(self, request, context):
        return pb.AbortResponse(found=await _ctl(self.worker.abort, request.request_id, request.writer_stopped))

    @unary
    async def Stats(self, request, context):
        load = await _ctl(self.load)
        counters = dict(self.worker.metrics)
        counters.update(self.worker.gen.decode_steps)
        cs = self.worker.counter.stats()
        counters.update(stale_immediates_dropped=cs.stale_dropped, invalid_immediates_dropped=cs.invalid_dropped,
                        transfer_timeouts=cs.timed_out, loop_errors=self.worker.watch.errors)
        counters.update(self.res.pool.allocator.stats, cached_blocks=self.res.pool.allocator.num_cached)
        es = self.res.transfer.stats()
        counters.update(kv_bytes_received=es.bytes_received, kv_writes_received=es.writes_received,
                        kv_writes_rejected=es.writes_rejected, auth_failures=es.auth_failures)
        return pb.StatsResponse(load=load, counters={k: float(v) for k, v in counters.items()})

    @unary
    async def Drain(self, request, context):
        await _ctl(self.worker.drain, 0.0)
        return pb.DrainResponse()

    # -- WorkerService ---------------------------------------------------------------------------
    def load(self) -> pb.LoadStats:
        d = self.worker.load()
        problem = check([self.worker.watch]) or (self.res.lost_reason if self.res.lost.is_set() else None)
        return pb.LoadStats(free_blocks=d.free_blocks, total_blocks=d.total_blocks, running=d.running,
                            waiting=d.waiting_kv, reserved_blocks=d.reserved_blocks, draining=d.draining,
                            unhealthy=problem is not None, unhealthy_reason=problem or "")

    def drain(self, timeout_s: float) -> None:
        self.worker.drain(timeout_s)

    def close(self) -> None:
        self.worker.close()


def _chunks(outputs: list) -> tuple[list[pb.TokenChunk], bool]:
    """(one chunk per choice, request finished) from a run of sink items; raises the error that
    ends a run."""
    by_choice: dict[int, pb.TokenChunk] = {}
    finished = False
    for item in outputs:
        if isinstance(item, Exception):
            raise item
        out: StepOutput = item
        chunk = by_choice.get(out.index)
        if chunk is None:
            chunk = by_choice[out.index] = pb.TokenChunk(index=out.index)
        chunk.token_ids.extend(out.new_token_ids)
        chunk.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs)
        chunk.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs or ())
        if out.finish_reason == FinishReason.ERROR:
            log.warning("sequence %s (choice %d) failed alone in its batch", out.request_id, out.index)
        if out.finish_reason is not None:
            chunk.finish_reason = out.finish_reason.value
        finished = finished or out.request_finished
    return list(by_choice.values()), finished
