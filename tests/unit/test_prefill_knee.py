"""`engine.prefill_knee`: the prompt tokens a CPU worker's pass batches up to, from real passes of
a tiny model timed once per machine, and the worker taking it where no ``--prefill-batch-tokens``
is given."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.prefill_knee import KNEE_SIZES, PROMPT_TOKENS, choose_batch_tokens, knee_from, measure_pass_rates
from engine.scheduling import CPU_BATCH_TOKENS
from tests.unit.test_engine_runner import TINY, _model

pytestmark = pytest.mark.unit

BS = 16
ROOM = max(KNEE_SIZES) // BS   # blocks the largest timed pass takes


@pytest.fixture(autouse=True)
def tuning_dir(tmp_path, monkeypatch):
    """Kept timings in the test's own directory, never the machine's."""
    directory = tmp_path / "pdserve-tuning"
    monkeypatch.setattr("engine.tuning.tuning_dir", lambda: directory)
    return directory


@pytest.mark.parametrize("rates, knee", [
    ({128: 2020.0, 256: 2742.0, 512: 3130.0, 1024: 3405.0}, 512),   # an AMX core's bfloat16 passes
    ({128: 603.0, 256: 645.0, 512: 594.0}, 128),                      # float32 on an AVX-512 EPYC
    ({128: 100.0, 256: 200.0, 512: 400.0, 1024: 800.0}, 1024),
    ({256: 90.0, 128: 100.0}, 128),                                   # unordered, the smallest wins
])
def test_the_knee_is_the_smallest_pass_within_the_fraction_of_the_best(rates, knee):
    assert knee_from(rates) == knee


def test_the_fraction_moves_the_knee_and_bad_rates_are_refused():
    rates = {128: 2020.0, 256: 2742.0, 512: 3130.0, 1024: 3405.0}
    assert knee_from(rates, 0.95) == 1024 and knee_from(rates, 0.8) == 256 and knee_from(rates, 0.5) == 128
    for bad, fraction in (({}, 0.9), ({128: 0.0}, 0.9), (rates, 0.0), (rates, 1.5)):
        with pytest.raises(ValueError):
            knee_from(bad, fraction)


def test_pass_rates_come_from_real_passes_whose_blocks_return_to_the_pool():
    model = _model(3)
    pool = KVPool(TINY, CacheConfig(block_size=BS, num_blocks=ROOM + 2))
    free = pool.allocator.num_free
    before = pool.kv.clone()
    rates = measure_pass_rates(model, pool, reps=1)
    assert sorted(rates) == list(KNEE_SIZES) and all(r > 0 for r in rates.values())
    assert pool.allocator.num_free == free
    assert not torch.equal(pool.kv, before)   # the passes wrote their K/V
    small = KVPool(TINY, CacheConfig(block_size=BS, num_blocks=3 * PROMPT_TOKENS // BS))
    assert sorted(measure_pass_rates(model, small, reps=1)) == [128, 256]   # what fits
    with pytest.raises(ValueError, match="cannot hold"):
        measure_pass_rates(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=4)), reps=1)
    with pytest.raises(ValueError, match="multiples"):
        measure_pass_rates(model, pool, sizes=(100,), reps=1)


def test_the_knee_is_timed_once_per_machine_and_read_back(tuning_dir):
    model = _model(3)
    pool = KVPool(TINY, CacheConfig(block_size=BS, num_blocks=ROOM + 2))
    knee, line = choose_batch_tokens(model, pool, 1, "fp32", 2048)
    (kept,) = tuning_dir.glob("prefill-knee-*.json")
    rates = {int(s): r for s, r in json.loads(kept.read_text())["rates"].items()}
    assert sorted(rates) == list(KNEE_SIZES) and knee == knee_from(rates)
    assert f"timed and kept in {tuning_dir}" in line
    kept.write_text(json.dumps({"rates": {"128": 1.0, "256": 1.0, "512": 1.0, "1024": 4.0}}))
    again, line = choose_batch_tokens(model, pool, 1, "fp32", 2048)
    assert (again, f"read from {tuning_dir}" in line) == (1024, True)   # the kept rates decide
    assert choose_batch_tokens(model, pool, 1, "fp32", 300)[0] == 300   # never above a pass's tokens
    kept.write_text(json.dumps({"rates": {"1024": 4.0}}))   # sizes missing: never half-read, timed again
    assert sorted(json.loads(kept.read_text())["rates"]) == ["1024"]
    choose_batch_tokens(model, pool, 1, "fp32", 2048)
    assert sorted(json.loads(kept.read_text())["rates"]) == sorted(map(str, KNEE_SIZES))
    kept.write_text(json.dumps({"rates": {"100": 1.0}}))   # a size never timed: timed again
    assert choose_batch_tokens(model, pool, 1, "fp32", 2048)[0] in KNEE_SIZES
    assert sorted(json.loads(kept.read_text())["rates"]) == sorted(map(str, KNEE_SIZES))
    assert len(list(tuning_dir.glob("prefill-knee-*.json"))) == 1
    choose_batch_tokens(model, pool, 2, "fp32", 2048)   # another thread count: its own timing
    assert len(list(tuning_dir.glob("prefill-knee-*.json"))) == 2


def test_a_pool_too_small_to_time_in_keeps_the_cpu_default(tuning_dir):
    pool = KVPool(TINY, CacheConfig(block_size=BS, num_blocks=ROOM - 1))
    knee, line = choose_batch_tokens(_model(3), pool, 1, "fp32", 2048)
    assert knee == CPU_BATCH_TOKENS and "not timed" in line and not list(tuning_dir.glob("*.json"))


def test_a_cpu_worker_takes_the_timed_knee_unless_told_one(smollm, caplog, tuning_dir):
    """`worker.runtime.build_resources`: a CPU worker without ``prefill_batch_tokens`` times the
    knee on its own pool and serves with it; one given a value keeps it and times nothing."""
    from worker.config import WorkerConfig
    from worker.runtime import build_resources

    with caplog.at_level(logging.INFO, logger="worker.runtime"):
        res = build_resources(WorkerConfig(role="prefill", transfer_engine="tcp", num_blocks=ROOM + 8), None, smollm)
    try:
        (kept,) = tuning_dir.glob("prefill-knee-*.json")
        rates = {int(s): r for s, r in json.loads(kept.read_text())["rates"].items()}
        assert res.config.prefill_batch_tokens == knee_from(rates)
        assert "prefill batch tokens:" in caplog.text
    finally:
        res.close()
    res = build_resources(WorkerConfig(role="prefill", transfer_engine="tcp", num_blocks=ROOM + 8,
                                       prefill_batch_tokens=96), None, smollm)
    try:
        assert res.config.prefill_batch_tokens == 96 and len(list(tuning_dir.glob("*knee*"))) == 1
    finally:
        res.close()
