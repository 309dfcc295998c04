"""Assemble a decode worker process: counter -> transfer engine -> `DecodeWorker` (the core) ->
`DecodeService` (gRPC) -> `WorkerProcess` (gRPC server + registration)."""

from __future__ import annotations

from decode.service import DecodeService
from decode.arrivals import DecodeArrivals
from decode.worker import DecodeWorker
from worker.config import WorkerConfig
from worker.runtime import WorkerProcess, build_resources

NUM_TRANSFER_SLOTS = 4096


def build_decode_process(config: WorkerConfig, loaded=None) -> WorkerProcess:
    """A ready-to-start decode `WorkerProcess` (``loaded`` lets tests share one loaded model)."""
    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    res = build_resources(config, arrivals=arrivals, loaded=loaded)
    worker = DecodeWorker(res, arrivals)
    return WorkerProcess(res, DecodeService(res, worker))
