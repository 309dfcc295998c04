"""`bench.startup`: it reads the kernel times from the lines a worker really logs, and sums up its
starts as compiled / eager."""

from __future__ import annotations

import logging

import pytest

from bench.startup import kernel_builds, summary
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from tests.unit.test_engine_runner import TINY, _model
from worker.config import WorkerConfig
from worker.kernels import set_attention_kernels

pytestmark = pytest.mark.unit


def test_kernel_times_come_from_the_workers_own_log_lines(tmp_path, caplog, monkeypatch):
    """The prompt kernel, timed against SDPA in a tuning directory of the test's own, logs its
    package built to be timed (and, where it won, another line for its thread counts: summed)."""
    monkeypatch.setattr("engine.tuning.tuning_dir", lambda: tmp_path / "pdserve-tuning")
    model, pool = _model(5), KVPool(TINY, CacheConfig(block_size=4, num_blocks=16))
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="decode", attention_backend="auto"), model, pool)
    glue = ("INFO worker.kernels: layer operators: compiled (engine.glue.CompiledGlue), ready in 2.5 s: "
            "6 package(s) for thread counts [1, 2], 6 built, 0 loaded from /tmp/x\n")   # a bfloat16 model's
    (tmp_path / "decode-0.log").write_text(caplog.text + glue)
    (tmp_path / "router.log").write_text("nothing compiled here\n")
    builds = kernel_builds(tmp_path)
    assert sorted(builds) == ["decode-0/decode attention", "decode-0/layer operators", "decode-0/prompt attention"]
    assert builds["decode-0/layer operators"] == 2.5
    (tmp_path / "decode-0.log").write_text(glue + glue)
    assert kernel_builds(tmp_path) == {"decode-0/layer operators": 5.0}
    assert all(seconds >= 0 for seconds in builds.values())


def test_the_summary_is_the_ratio_of_medians():
    rows = [{"config": "eager", "seconds": s} for s in (4.0, 5.0, 9.0)]
    rows += [{"config": "compiled", "seconds": s} for s in (6.0, 6.5, 20.0)]
    rows.append({"config": "compiled, cold cache", "seconds": 60.0})
    assert summary(rows) == {"median_eager_s": 5.0, "median_compiled_s": 6.5, "ratio": 1.3}
