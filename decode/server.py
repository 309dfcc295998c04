"""Assemble a decode worker process: counter -> transfer engine -> worker -> service -> server."""

from __future__ import annotations

from decode.service import DecodeService
from decode.arrivals import DecodeArrivals
from decode.worker import DecodeWorker
from worker.config import WorkerConfig
from worker.runtime import WorkerServer, build_resources

NUM_TRANSFER_SLOTS = 4096


def build_decode_server(config: WorkerConfig, loaded=None) -> WorkerServer:
    """A ready-to-start decode `WorkerServer` (``loaded`` lets tests share one loaded model)."""
    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    res = build_resources(config, arrivals=arrivals, loaded=loaded)
    worker = DecodeWorker(res, arrivals)
    return WorkerServer(res, DecodeService(res, worker))
