"""Assemble a decode worker process: counter -> transfer engine -> worker -> service -> server."""

from __future__ import annotations

from decode.service import DecodeService
from decode.worker import DecodeWorker
from kvtransfer import CompletionCounter
from worker.config import WorkerConfig
from worker.runtime import WorkerServer, build_resources

NUM_TRANSFER_SLOTS = 1024


def build_decode_server(config: WorkerConfig, loaded=None) -> WorkerServer:
    """A ready-to-start decode `WorkerServer` (``loaded`` lets tests share one loaded model)."""
    counter = CompletionCounter(NUM_TRANSFER_SLOTS)
    res = build_resources(config, arrivals=counter, loaded=loaded)
    worker = DecodeWorker(res, counter)
    return WorkerServer(res, DecodeService(res, worker))
