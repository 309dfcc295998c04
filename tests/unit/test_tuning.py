"""`engine.tuning`: the 4-bit projections' plans are timed once, kept on disk, and read back by
later loads, so every process on a machine holds the same plan (and answers alike)."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest
import torch

from engine import tuning
from engine.quant import Int4Linear, Int4Weight, int4_kernel_available

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not int4_kernel_available(),
                                reason="this torch build has no working CPU int4 kernel")

# 3 rows is not among the row counts a timing can choose (engine.quant.ROW_CANDIDATES): a plan
# with it came from the file
KEPT = ("int4", 3)


def _linears(n=64, k=128):
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return [Int4Linear(Int4Weight.from_gguf(data, "Q4_1", (n, k)), 0, "torch", kernels=("int4", "nbits"))
            for _ in range(3)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # not the machine's cache
    return tmp_path / tuning.SUBDIR


def _file(linears, threads):
    return tuning.tuning_dir() / f"low-bit-{tuning.plan_key(linears, threads)}.json"


def test_a_plan_is_timed_once_then_read_back_and_followed(cache):
    plans, how = tuning.tuned_low_bit_plans(_linears(), (1,))
    assert "timed on 1 thread(s)" in how and set(plans) == {1}
    kept = json.loads(_file(_linears(), 1).read_text())
    assert (kept["threads"], kept["kernel"], kept["max_rows"]) == (1, *plans[1])
    assert tuning.tuned_low_bit_plans(_linears(), (1,)) == (plans, f"read from {cache}")
    _file(_linears(), 1).write_text(json.dumps({"threads": 1, "kernel": KEPT[0], "max_rows": KEPT[1]}))
    linears = _linears()
    assert tuning.tuned_low_bit_plans(linears, (1,))[0] == {1: KEPT}
    x = torch.randn(3, 128)
    assert all(p.plans == {1: KEPT} and p._nbits is None for p in linears)   # the other kernel freed
    assert torch.equal(linears[0](x), linears[0].int4(x).to(x.dtype))   # 3 rows: the low-bit kernel
    assert torch.equal(linears[0](torch.cat([x, x[:1]])), linears[0].dense(torch.cat([x, x[:1]])))


def test_each_thread_count_and_shape_has_its_own_plan(cache):
    small, other = _linears(), _linears(n=96)
    assert len({tuning.plan_key(small, 1), tuning.plan_key(small, 2), tuning.plan_key(other, 1)}) == 3
    tuning.tuned_low_bit_plans(small, (1,))
    _file(_linears(), 1).write_text(json.dumps({"threads": 1, "kernel": KEPT[0], "max_rows": KEPT[1]}))
    plans, how = tuning.tuned_low_bit_plans(_linears(), (2, 1))   # 1 read back, 2 timed
    assert plans[1] == KEPT and set(plans) == {1, 2} and "timed on 2 thread(s)" in how
    assert _file(_linears(), 2).exists()
    with pytest.raises(ValueError, match="thread counts"):
        tuning.tuned_low_bit_plans(_linears(), (0,))


@pytest.mark.parametrize("text, field", [
    ("{not json", "Expecting property name"),
    (json.dumps({"threads": 1, "kernel": "fp8", "max_rows": 4}), "'kernel' is 'fp8'"),
    (json.dumps({"threads": 1, "kernel": "int4", "max_rows": -1}), "'max_rows' is -1"),
    (json.dumps({"threads": 1, "kernel": "int4", "max_rows": True}), "'max_rows' is True"),
    (json.dumps({"threads": 2, "kernel": "int4", "max_rows": 4}), "'threads' is 2"),
    (json.dumps({"threads": 1, "kernel": "int4"}), "'max_rows'"),
])
def test_a_file_that_cannot_be_read_back_is_named_timed_again_and_replaced(cache, caplog, text, field):
    cache.mkdir(parents=True)
    _file(_linears(), 1).write_text(text)
    with caplog.at_level(logging.WARNING, logger="engine.tuning"):
        plans, how = tuning.tuned_low_bit_plans(_linears(), (1,))
    assert "timed on 1 thread(s)" in how
    assert str(_file(_linears(), 1)) in caplog.text and field in caplog.text
    assert json.loads(_file(_linears(), 1).read_text())["kernel"] == plans[1][0]


@pytest.mark.parametrize("blocked", ["directory", "lock"])
def test_without_a_usable_directory_the_plans_are_timed_and_the_log_says_so(tmp_path, monkeypatch, caplog, blocked):
    if blocked == "directory":
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file"))   # no directory can be made in it
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        (tmp_path / tuning.SUBDIR / ".lock").mkdir(parents=True)   # the lock cannot be opened
    with caplog.at_level(logging.WARNING, logger="engine.tuning"):
        plans, how = tuning.tuned_low_bit_plans(_linears(), (1,))
    assert how == "timed, not kept" and set(plans) == {1} and "cannot be used" in caplog.text
    assert not list(tmp_path.rglob("low-bit-*.json"))


def test_a_plan_that_cannot_be_written_is_used_and_the_log_says_it_was_not_kept(cache, caplog):
    cache.mkdir(parents=True)
    _file(_linears(), 1).mkdir()   # the file's name taken by a directory: the rename fails
    with caplog.at_level(logging.WARNING, logger="engine.tuning"):
        plans, how = tuning.tuned_low_bit_plans(_linears(), (1,))
    assert set(plans) == {1} and how == f"timed on 1 thread(s) and not kept: {cache}"
    assert "not kept in" in caplog.text and not list(cache.glob(".*.tmp"))


def test_loads_together_time_once_the_later_one_reads_what_the_first_kept(cache):
    """A load that finds the directory locked waits and then reads the plan instead of timing
    its own (the plan written under the lock has a row count no timing gives)."""
    cache.mkdir(parents=True)
    results = []
    with tuning._locked(cache / ".lock"):   # a first load, timing
        waiter = threading.Thread(target=lambda: results.append(tuning.tuned_low_bit_plans(_linears(), (1,))),
                                  name="test-second-load")
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not results   # waiting on the lock
        _file(_linears(), 1).write_text(json.dumps({"threads": 1, "kernel": KEPT[0], "max_rows": KEPT[1]}))
    waiter.join(60)
    assert not waiter.is_alive() and results == [({1: KEPT}, f"read from {cache}")]
