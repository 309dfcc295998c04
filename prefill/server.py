"""Assemble a prefill worker process: transfer engine -> worker -> service -> server."""

from __future__ import annotations

from prefill.service import PrefillService
from prefill.worker import PrefillWorker
from worker.config import WorkerConfig
from worker.runtime import WorkerServer, build_resources


def build_prefill_server(config: WorkerConfig, loaded=None) -> WorkerServer:
    """A ready-to-start prefill `WorkerServer` (``loaded`` lets tests share one loaded model)."""
    res = build_resources(config, loaded=loaded)
    return WorkerServer(res, PrefillService(res, PrefillWorker(res)))
