"""`worker.cpu_board`: the host's CPU board seen through two mappings, a worker's loans of idle
CPUs (the calling thread's affinity widened for a pass and narrowed after), a pass that borrows
and gives back at the layer its owner wants the CPU again, and the launcher's plan of loans."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from deploy.launcher import Cluster, LauncherConfig
from engine.attention import SeqChunk
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.runner import ModelRunner
from tests.unit.test_engine_runner import BS, TINY, _model, _Seq
from worker.config import WorkerConfig
from worker.cpu_board import CpuBoard, CpuLending
from worker.runtime import run_on_own_thread

pytestmark = pytest.mark.unit

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="lending needs 2 CPUs (this machine has 1)")


def _on_thread(fn):
    """``fn()`` on a thread of its own: affinity changes stay off pytest's thread."""
    return run_on_own_thread("test-lending", fn)


def test_marks_are_seen_through_another_mapping(tmp_path):
    owner = CpuBoard.create(tmp_path / "board", 4)
    borrower = CpuBoard(tmp_path / "board", 4)
    assert borrower.idle(range(4)) == []            # busy until an owner says it waits
    owner.mark([1, 3], busy=False)
    assert borrower.idle(range(4)) == [1, 3]
    owner.mark([3], busy=True)
    assert borrower.idle(range(4)) == [1]
    with pytest.raises(ValueError, match="CPU 4"):
        borrower.idle([4])
    with pytest.raises(ValueError, match="8 needed"):
        CpuBoard(tmp_path / "board", 8)
    owner.close()
    borrower.close()


def test_lending_refuses_an_overlap_and_a_cpu_off_the_board(tmp_path):
    board = CpuBoard.create(tmp_path / "board", 2)
    with pytest.raises(ValueError, match="apart"):
        CpuLending(board, {0}, {0, 1})
    with pytest.raises(ValueError, match="CPU 5"):
        CpuLending(board, {0}, {5})


@two_cpus
def test_a_loan_widens_the_calling_thread_and_the_owner_takes_it_back(tmp_path):
    own, lent = CPUS[0], CPUS[1]
    board = CpuBoard.create(tmp_path / "board", lent + 1)
    borrower = CpuLending(board, {own}, {lent})
    owner = CpuLending(CpuBoard(tmp_path / "board"), {lent}, {own})

    def scenario():
        borrower.pin_to_own()
        seen = [os.sched_getaffinity(0)]
        assert borrower.take() == 0                  # the owner has not said it waits
        owner.busy(False)
        assert borrower.take() == 1 and not borrower.reclaimed()
        seen.append(os.sched_getaffinity(0))
        owner.busy(True)
        assert borrower.reclaimed()
        borrower.give_back()
        seen.append(os.sched_getaffinity(0))
        return seen

    assert _on_thread(scenario) == [{own}, {own, lent}, {own}]
    owner.close()
    assert board.idle([lent]) == []                  # a worker gone lends nothing


@two_cpus
def test_a_long_pass_borrows_an_idle_cpu_while_its_owner_waits(tmp_path):
    """A prompt chunk runs on a second thread while the lent CPU's owner waits; once the owner
    has work, the next layers run on the runner's own thread, and once it waits again (its work
    done mid-pass) the next layers borrow again; the logits are those of a pass
    that never borrowed, and short passes never borrow."""
    own, lent = CPUS[0], CPUS[1]
    board = CpuBoard.create(tmp_path / "board", lent + 1)
    owner = CpuLending(CpuBoard(tmp_path / "board"), {lent}, {own})
    config = dataclasses.replace(TINY, num_layers=4)
    model = _model(config=config)
    layers = []

    def after_layer(i):
        layers.append((torch.get_num_threads(), os.sched_getaffinity(0)))
        if i in (0, 2):
            owner.busy(True)                         # the owner's loop found work
        if i == 1:
            owner.busy(False)                        # ... and waits again

    def scenario():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            lending = CpuLending(board, {own}, {lent})
            lending.pin_to_own()
            out = {}
            for name, borrowing in (("lent", lending), ("alone", None)):
                runner = ModelRunner(model, KVPool(config, CacheConfig(block_size=BS, num_blocks=32)),
                                     parallel_min_tokens=8, borrowing=borrowing)
                seq = _Seq(list(range(1, 13)))
                assert runner.grow(seq, 12)
                owner.busy(False)
                out[name] = runner.execute([(seq, SeqChunk(seq.prompt_token_ids, 0, seq.block_table))],
                                           on_layer_done=after_layer)
                out[name + " threads after"] = torch.get_num_threads()
                out[name + " affinity after"] = os.sched_getaffinity(0)
            owner.busy(False)
            short = ModelRunner(model, KVPool(config, CacheConfig(block_size=BS, num_blocks=32)),
                                parallel_min_tokens=8, borrowing=lending)
            seq = _Seq(list(range(1, 5)))
            assert short.grow(seq, 4)
            short.execute([(seq, SeqChunk(seq.prompt_token_ids, 0, seq.block_table))],
                          on_layer_done=lambda i: layers.append((torch.get_num_threads(), os.sched_getaffinity(0))))
            return out
        finally:
            torch.set_num_threads(before)

    out = _on_thread(scenario)
    both, alone = (2, {own, lent}), (1, {own})
    assert layers == [both, alone, both, alone] + [alone] * 4 + [alone] * 4   # lent; alone; short
    assert out["lent threads after"] == 1 and out["lent affinity after"] == {own}
    torch.testing.assert_close(out["lent"], out["alone"], rtol=1e-6, atol=1e-6)


def test_worker_config_names_its_lending_fields():
    assert WorkerConfig(role="prefill", cpu_board="/b", borrow_cpus="1,3").lent_cpus() == (1, 3)
    with pytest.raises(ValueError, match="both or neither"):
        WorkerConfig(role="prefill", borrow_cpus="1")
    with pytest.raises(ValueError, match="borrow_cpus"):
        WorkerConfig(role="prefill", cpu_board="/b", borrow_cpus="one")
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        WorkerConfig(role="prefill", cpu_board="/b", borrow_cpus="1", tensor_parallel_size=2)


def test_the_launcher_lends_each_pinned_worker_the_others_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    c = Cluster(LauncherConfig(cpu_affinity=(0, 1), log_dir=str(tmp_path)))
    assert c.lent == {"prefill-0": {1}, "decode-0": {0}}
    for w in c.workers:
        assert w.argv[w.argv.index("--cpu-board") + 1] == str(tmp_path / "cpu-board")
    assert [w.argv[w.argv.index("--borrow-cpus") + 1] for w in c.workers] == ["1", "0"]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    c = Cluster(LauncherConfig(cpu_affinity=(0, 1, 2, 3), threads=2, log_dir=str(tmp_path)))
    assert c.cpus == {"prefill-0": (0, 1), "decode-0": (2, 3)}   # two CPUs of its own each
    assert c.lent == {"prefill-0": {2, 3}, "decode-0": {0, 1}}
    for kw in ({}, {"cpu_affinity": (0,), "num_decode": 2}, {"cpu_affinity": (0, 1), "lend_idle_cpus": False},
               {"cpu_affinity": (0, 1, 2), "decode_tp": (2,)}, {"cpu_affinity": (0, 1, 2), "threads": 2}):
        c = Cluster(LauncherConfig(log_dir=str(tmp_path), **kw))   # unpinned, a shared CPU, off, TP, overlap
        assert c.lent == {} and not any("--cpu-board" in w.argv for w in c.workers)
