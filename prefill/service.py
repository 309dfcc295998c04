"""gRPC `Prefill` service over a `PrefillWorker` (see rpc/pdserve.proto for the contract)."""

from __future__ import annotations

import logging

import grpc

from engine.errors import CapacityError, InvalidRequestError
from kvtransfer import AuthError, EndpointInfo, KVTransferError, TransferTimeout
from prefill.worker import PrefillAborted, PrefillError, PrefillTimeout, PrefillWorker
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.convert import sampling_from_proto
from worker.runtime import WorkerResources

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillServicer):
    """The prefill worker's RPC surface."""

    def __init__(self, res: WorkerResources, worker: PrefillWorker):
        self.res = res
        self.worker = worker

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_PrefillServicer_to_server(self, server)

    def Describe(self, request, context):
        return pb.Endpoint(engine=self.res.transfer.name, description=self.res.transfer.describe().to_bytes())

    def Connect(self, request, context):
        try:
            info = EndpointInfo.from_bytes(request.peer_endpoint.description)
            self.worker.connect(request.peer_worker_id, info)
        except AuthError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"data plane: {exc}")
        except KVTransferError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"data plane: {exc}")
        return pb.ConnectResponse(endpoint=self.Describe(None, context))

    def Disconnect(self, request, context):
        self.worker.disconnect(request.peer_worker_id)
        return pb.DisconnectResponse()

    def Prefill(self, request, context):
        try:
            params = sampling_from_proto(request.sampling)
            result = self.worker.prefill(request.request_id, list(request.token_ids), params,
                                         request.decode_worker_id, list(request.block_ids),
                                         request.slot, request.generation)
        except (InvalidRequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except PrefillAborted as exc:
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except (PrefillTimeout, TransferTimeout) as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (PrefillError, KVTransferError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return pb.PrefillResponse(first_token=result.first_token, num_writes=result.num_writes,
                                  bytes_written=result.bytes_written, prefill_seconds=result.compute_seconds,
                                  transfer_seconds=result.transfer_seconds)

    def Abort(self, request, context):
        return pb.AbortResponse(found=self.worker.abort(request.request_id))

    def Stats(self, request, context):
        counters = dict(self.worker.metrics)
        es = self.res.transfer.stats()
        counters.update(kv_writes_posted=es.writes_posted, kv_bytes_posted=es.bytes_posted,
                        peers_lost=es.peers_lost)
        return pb.StatsResponse(load=self.load(), counters={k: float(v) for k, v in counters.items()})

    def Drain(self, request, context):
        self.worker.drain(0.0)
        return pb.DrainResponse()

    def load(self) -> pb.LoadStats:
        free, total, queued, queued_tokens, draining = self.worker.load()
        return pb.LoadStats(free_blocks=free, total_blocks=total, waiting=queued,
                            queued_prompt_tokens=queued_tokens, draining=draining)

    def drain(self, timeout_s: float) -> None:
        self.worker.drain(timeout_s)

    def close(self) -> None:
        self.worker.close()
