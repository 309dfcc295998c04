"""`bench.threads`: its pass timings give every block back and go through the attention kernels a
worker runs, and its busy neighbour process has a name and stops."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import torch

from bench.threads import Neighbour, time_passes, use_worker_kernels
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.runner import ModelRunner
from tests.unit.test_engine_runner import TINY, _model

pytestmark = pytest.mark.unit


def test_time_passes_times_each_pass_kind_and_frees_its_blocks():
    pool = KVPool(TINY, CacheConfig(block_size=4, num_blocks=64))
    seconds = time_passes(ModelRunner(_model(), pool, parallel_min_tokens=8), pool, reps=2, context=12,
                          batches=(1, 3))
    assert set(seconds) == {"decode x1", "prefill 12", "decode x3"}
    assert all(s > 0 for s in seconds.values())
    assert pool.allocator.num_free == 64


def test_the_timed_decode_steps_run_the_workers_compiled_decode_kernel():
    model, pool = _model(), KVPool(TINY, CacheConfig(block_size=4, num_blocks=64))
    threads = torch.get_num_threads()
    assert use_worker_kernels(model, pool, counts=(1,), prompt_threads=None) > 0
    assert torch.get_num_threads() == threads
    assert model.prefill_kernel is not None
    calls = []
    kernel = model.decode_kernel

    def counted(q, *args):
        calls.append(q.shape[0])
        return kernel(q, *args)

    model.decode_kernel = counted
    counted.min_rows = kernel.min_rows
    time_passes(ModelRunner(model, pool, parallel_min_tokens=0), pool, reps=1, context=12, batches=(4,))
    assert calls and set(calls) == {4}   # every layer of the 4-row steps, none of the prompt passes
    assert pool.allocator.num_free == 64


def test_the_neighbour_is_named_pinned_and_stopped():
    cpu = min(os.sched_getaffinity(0))
    n = Neighbour(cpu)
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{n.proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)   # empty until the child has exec'd
        cmdline = Path(f"/proc/{n.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0] == b"bench-neighbour"
        assert os.sched_getaffinity(n.proc.pid) == {cpu}
    finally:
        n.stop()
    assert n.proc.returncode is not None
    assert not Path(f"/proc/{n.proc.pid}").exists()
