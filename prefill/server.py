"""Assemble a prefill worker process: transfer engine -> `PrefillWorker` (the core) ->
`PrefillService` (gRPC) -> `WorkerProcess` (gRPC server + registration)."""

from __future__ import annotations

from prefill.service import PrefillService
from prefill.worker import PrefillWorker
from worker.config import WorkerConfig
from worker.runtime import WorkerProcess, build_resources


def build_prefill_process(config: WorkerConfig, loaded=None) -> WorkerProcess:
    """A ready-to-start prefill `WorkerProcess` (``loaded`` lets tests share one loaded model)."""
    res = build_resources(config, loaded=loaded)
    return WorkerProcess(res, PrefillService(res, PrefillWorker(res)))
