"""Liveness of the workers' loops, in process on the real model: an exception in a loop body
is counted and the loop goes on; a stalled or dead loop makes the worker report itself unhealthy
(and the router stops routing to it); the loops stop on close."""

from __future__ import annotations

import threading
import time

import pytest

from decode.arrivals import DecodeArrivals
from decode.server import NUM_TRANSFER_SLOTS
from decode.service import DecodeService
from decode.sink import QueueSink
from decode.worker import DecodeWorker
from engine.sampling import SamplingParams
from prefill.service import PrefillService
from prefill.worker import PrefillWorker
from worker.config import WorkerConfig
from worker.runtime import build_resources

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def decode(smollm):
    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    res = build_resources(WorkerConfig(role="decode", transfer_engine="tcp", num_blocks=64), arrivals, smollm)
    worker = DecodeWorker(res, arrivals)
    yield worker, DecodeService(res, worker)
    worker.close()
    res.close()
    assert not worker._thread.is_alive()


def _generate(worker: DecodeWorker, rid: str, prompt: list[int], n: int = 8) -> list[int]:
    sink = QueueSink()
    worker.serve_colocated(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), sink)
    tokens = []
    while True:
        out = sink.items.get(timeout=60)
        tokens += out.new_token_ids
        if out.finished:
            return tokens


def test_an_exception_in_the_decode_loop_is_survived(decode, smollm, monkeypatch):
    worker, service = decode
    prompt = smollm.tokenizer.encode("Hello there")
    want = _generate(worker, "before", prompt)
    real, failures = worker._housekeeping, []

    def failing_once():   # an injected fault outside the step's own try
        if not failures:
            failures.append(1)
            raise RuntimeError("injected fault in housekeeping")
        real()

    monkeypatch.setattr(worker, "_housekeeping", failing_once)
    worker._wake.set()
    assert _generate(worker, "after", prompt) == want
    assert failures and worker.watch.errors == 1
    assert not service.load().unhealthy


def test_a_stalled_or_dead_loop_reports_unhealthy(decode):
    worker, service = decode
    worker.watch.stall_s = 0.5
    assert not service.load().unhealthy
    with worker._lock:                      # the loop cannot take its lock: it stalls
        time.sleep(1.0)
        load = service.load()               # (the gate's lock is reentrant)
    assert load.unhealthy and "decode-loop made no progress" in load.unhealthy_reason
    deadline = time.monotonic() + 5
    while service.load().unhealthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not service.load().unhealthy    # it recovered
    worker._stop.set()                       # the loop thread ends as if it had died
    worker._wake.set()
    worker._thread.join(5)
    load = service.load()
    assert load.unhealthy and "died" in load.unhealthy_reason


def test_prefill_loops_are_watched_and_stop_on_close(smollm):
    res = build_resources(WorkerConfig(role="prefill", transfer_engine="tcp", num_blocks=32), None, smollm)
    worker = PrefillWorker(res)
    service = PrefillService(res, worker)
    try:
        assert [w.name for w in worker.watches] == ["prefill-loop", "prefill-sender"]
        assert not service.load().unhealthy
    finally:
        worker.close()
        res.close()
    assert not any(t.name in ("prefill-loop", "prefill-sender") for t in threading.enumerate())
    assert not service.load().unhealthy     # closed on purpose: not a failure


def test_the_decode_workers_prompt_budget_while_decoding_is_its_flag(smollm):
    """``--max-prefill-tokens-while-decoding``: a prompt arriving while another request decodes
    joins the passes at most that many tokens at a time, and both answers are unchanged. A decode
    worker times no prefill knee: its passes batch prompts up to ``max_num_batched_tokens``, as
    vLLM's scheduler (`worker.config.WorkerConfig.prefill_batch_tokens`)."""
    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    res = build_resources(WorkerConfig(role="decode", transfer_engine="tcp", num_blocks=64,
                                       max_prefill_tokens_while_decoding=16), arrivals, smollm)
    worker = DecodeWorker(res, arrivals)
    try:
        assert res.config.prefill_batch_tokens == 0
        assert worker.gen.config.prefill_batch_tokens == res.config.max_num_batched_tokens
        long_prompt = smollm.tokenizer.encode("Tell me a story about a lighthouse keeper. " * 8)
        assert len(long_prompt) > 64
        want = _generate(worker, "alone", long_prompt)
        budgets, real = [], worker.gen._schedule_prefill

        def schedule(budget):
            if worker.gen.running:
                budgets.append(budget)
            return real(budget)

        worker.gen._schedule_prefill = schedule
        first = QueueSink()
        worker.serve_colocated("decoding", smollm.tokenizer.encode("Hello there"),
                               SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), first)
        assert first.items.get(timeout=60).new_token_ids   # decoding now
        assert _generate(worker, "beside", long_prompt) == want
        assert budgets and max(budgets) == 16, budgets
    finally:
        worker.close()
        res.close()
    assert not worker._thread.is_alive()
