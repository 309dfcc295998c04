"""gRPC `Decode` service over a `DecodeWorker` (see rpc/pdserve.proto for the contract)."""

from __future__ import annotations

import logging

import grpc

from decode.worker import DecodeWorker, DrainingError, UnknownRequestError
from engine.errors import CapacityError, InvalidRequestError
from kvtransfer import EndpointInfo, KVTransferError, PeerLostError, TransferTimeout
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.convert import sampling_from_proto
from worker.runtime import WorkerResources

log = logging.getLogger(__name__)


class DecodeService(pb_grpc.DecodeServicer):
    """The decode worker's RPC surface."""

    def __init__(self, res: WorkerResources, worker: DecodeWorker):
        self.res = res
        self.worker = worker
        self._peers: dict[str, str] = {}  # prefill worker id -> its endpoint id

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_DecodeServicer_to_server(self, server)

    # -- brokering ------------------------------------------------------------------------------
    def Describe(self, request, context):
        return pb.Endpoint(engine=self.res.transfer.name, description=self.res.transfer.describe().to_bytes())

    def Connect(self, request, context):
        # Writers connect to us (tcp/shm); we only remember who they are.
        if request.peer_endpoint.description:
            try:
                info = EndpointInfo.from_bytes(request.peer_endpoint.description)
            except KVTransferError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self._peers[request.peer_worker_id] = info.endpoint_id
        return pb.ConnectResponse(endpoint=self.Describe(None, context))

    def Disconnect(self, request, context):
        self._peers.pop(request.peer_worker_id, None)
        return pb.DisconnectResponse()

    # -- requests -------------------------------------------------------------------------------
    def Reserve(self, request, context):
        try:
            r = self.worker.reserve(request.request_id, request.num_prompt_tokens, request.max_tokens)
        except CapacityError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DrainingError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (InvalidRequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ReserveResponse(block_ids=r.blocks, slot=r.slot, generation=r.generation)

    def Decode(self, request, context):
        rid = request.request_id
        try:
            params = sampling_from_proto(request.sampling)
            r = self.worker.start_decode(rid, request.first_token, request.num_writes,
                                         list(request.prompt_token_ids), params)
        except UnknownRequestError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation for request {rid}")
        except InvalidRequestError as exc:
            self.worker.abort(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferTimeout as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV transfer: {exc}")
        except PeerLostError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer: {exc}")
        except KVTransferError as exc:
            context.abort(grpc.StatusCode.ABORTED, f"KV transfer: {exc}")
        context.add_callback(lambda: self.worker.abort(rid))  # client gone -> blocks return
        yield from self._stream(r)

    def Generate(self, request, context):
        rid = request.request_id
        try:
            params = sampling_from_proto(request.sampling)
            r = self.worker.generate_local(rid, list(request.prompt_token_ids), params)
        except CapacityError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DrainingError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (InvalidRequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: self.worker.abort(rid))
        yield from self._stream(r)

    def _stream(self, r):
        while True:
            out = r.outputs.get()
            reason = out.finish_reason.value if out.finish_reason is not None else ""
            yield pb.TokenChunk(token_ids=out.new_token_ids, finish_reason=reason)
            if out.finished:
                return

    def Abort(self, request, context):
        return pb.AbortResponse(found=self.worker.abort(request.request_id, request.writer_stopped))

    def Stats(self, request, context):
        counters = dict(self.worker.metrics)
        cs = self.worker.counter.stats()
        counters.update(stale_immediates_dropped=cs.stale_dropped, invalid_immediates_dropped=cs.invalid_dropped,
                        transfer_timeouts=cs.timed_out)
        es = self.res.transfer.stats()
        counters.update(kv_bytes_received=es.bytes_received, kv_writes_received=es.writes_received,
                        kv_writes_rejected=es.writes_rejected, auth_failures=es.auth_failures)
        return pb.StatsResponse(load=self.load(), counters={k: float(v) for k, v in counters.items()})

    def Drain(self, request, context):
        self.worker.drain(0.0)
        return pb.DrainResponse()

    # -- WorkerService ---------------------------------------------------------------------------
    def load(self) -> pb.LoadStats:
        free, total, running, waiting, reserved, draining = self.worker.load()
        return pb.LoadStats(free_blocks=free, total_blocks=total, running=running, waiting=waiting,
                            reserved_blocks=reserved, draining=draining)

    def drain(self, timeout_s: float) -> None:
        self.worker.drain(timeout_s)

    def close(self) -> None:
        self.worker.close()
