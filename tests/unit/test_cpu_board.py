"""`worker.cpu_board`: the host's CPU board seen through two mappings, a worker's loans of idle
CPUs (the calling thread's affinity widened for a pass and narrowed after, or libgomp's threads
bound one per CPU by the launcher), a pass that borrows
and gives back at the layer its owner wants the CPU again, and the launcher's plan of loans."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from deploy.launcher import Cluster, LauncherConfig, thread_places
from engine.attention import SeqChunk
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from engine.runner import ModelRunner
from tests.unit.test_engine_runner import BS, TINY, _model, _Seq
from worker.config import WorkerConfig
from worker.cpu_board import CpuBoard, CpuLending, omp_binds_threads, process_cpus
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
def test_a_loan_of_bound_threads_leaves_the_calling_thread_on_its_own_cpu(tmp_path):
    """With libgomp binding the threads (`omp_binds_threads`), a loan changes no affinity: the
    pass's extra thread is already on the lent CPU (`test_libgomp_binds_a_borrowed_pass_one_thread_per_cpu`)."""
    own, lent = CPUS[0], CPUS[1]
    board = CpuBoard.create(tmp_path / "board", lent + 1)
    borrower = CpuLending(board, {own}, {lent}, threads_bound=True)
    owner = CpuLending(CpuBoard(tmp_path / "board"), {lent}, {own})

    def scenario():
        borrower.pin_to_own()
        owner.busy(False)
        taken = borrower.take()
        seen = [os.sched_getaffinity(0)]
        owner.busy(True)
        reclaimed = borrower.reclaimed()
        borrower.give_back()
        return taken, reclaimed, seen + [os.sched_getaffinity(0)]

    assert _on_thread(scenario) == (1, True, [{own}, {own}])
    owner.close()
    # two lent CPUs, the first busy: libgomp would put the extra thread on it, so none is taken
    wide = CpuBoard.create(tmp_path / "wide", 4)
    wide.mark([3], busy=False)
    assert CpuLending(wide, {0}, {2, 3}, threads_bound=True).take() == 0
    wide.mark([2], busy=False)
    assert CpuLending(wide, {0}, {2, 3}, threads_bound=True).take() == 2


_BOUND_PASS = r"""
import glob, json, os, sys, threading
import torch
from worker.cpu_board import CpuBoard, CpuLending, omp_binds_threads, process_cpus

own, lent, board = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = {"bound": omp_binds_threads(), "process_cpus": sorted(process_cpus())}

def loop():  # the worker's compute loop: a thread of its own, one torch thread until it borrows
    lending = CpuLending(CpuBoard(board), {own}, {lent}, threads_bound=omp_binds_threads())
    lending.pin_to_own()
    torch.set_num_threads(1 + lending.take())
    a = torch.randn(768, 768)
    for _ in range(20):
        a @ a
    me = threading.get_native_id()
    tasks = {int(os.path.basename(t)): sorted(os.sched_getaffinity(int(os.path.basename(t))))
             for t in glob.glob("/proc/self/task/*")}
    out["master"] = tasks.pop(me)
    out["others"] = sorted(tasks.values())
    lending.give_back()
    out["master_after"] = sorted(os.sched_getaffinity(0))

t = threading.Thread(target=loop, name="loop")
t.start()
t.join()
print(json.dumps(out))
"""


@two_cpus
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
def test_libgomp_binds_a_borrowed_pass_one_thread_per_cpu(tmp_path, bound):
    """A worker started as the launcher starts a lending one (`thread_places`: its own CPU
    first, then the lent one, ``OMP_PROC_BIND=close``; the process allowed both) runs a borrowed
    pass's two OpenMP threads one on each CPU, the master on its own, so the scheduler cannot put
    both on one CPU for the pass; and `process_cpus` still sees both CPUs although libgomp
    bound the main thread. Without the binding (the control), the extra thread may run on
    either CPU and the master is widened for the pass."""
    import json
    import subprocess
    import sys

    own, lent = CPUS[1], CPUS[0]   # the decode worker's order: its CPU is not the first
    board = CpuBoard.create(tmp_path / "board", max(own, lent) + 1)
    CpuLending(CpuBoard(tmp_path / "board"), {lent}, {own}).busy(False)   # the lent CPU's owner waits
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")}
    if bound:
        env.update(OMP_PLACES=thread_places((own,), {lent}), OMP_PROC_BIND="close")
    result = subprocess.run([sys.executable, "-c", _BOUND_PASS, str(own), str(lent), str(tmp_path / "board")],
                            env=env, capture_output=True, text=True, timeout=120, check=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {own, lent}))
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["bound"] is bound and out["process_cpus"] == sorted({own, lent})
    if bound:
        assert out["master"] == [own] and [lent] in out["others"]
    else:
        assert out["master"] == sorted([own, lent]) and [lent] not in out["others"]   # widened for the pass
    assert out["master_after"] == [own]
    board.close()


def test_thread_places_and_the_binding_switch(monkeypatch):
    assert thread_places((1,), {0}) == "{1},{0}"
    assert thread_places((2, 3), {1, 0}) == "{2},{3},{0},{1}"
    assert omp_binds_threads({"OMP_PLACES": "{1},{0}", "OMP_PROC_BIND": "close"})
    assert not omp_binds_threads({"OMP_PLACES": "{1},{0}"})
    assert not omp_binds_threads({"OMP_PLACES": "{1},{0}", "OMP_PROC_BIND": "false"})
    assert not omp_binds_threads({"OMP_PROC_BIND": "close"})
    assert process_cpus({"OMP_PLACES": "{3},{1}", "OMP_PROC_BIND": "close"}) == {1, 3}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {5})
    assert process_cpus({"OMP_PLACES": "cores", "OMP_PROC_BIND": "close"}) == {5}   # a form not parsed
    assert process_cpus({}) == {5}


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


def test_the_launcher_binds_each_pinned_workers_threads(tmp_path, monkeypatch):
    """`pdserve up`'s pair: each worker's OpenMP threads bound to its own CPU first, then the one
    it may borrow (`thread_places`); a colocated worker of two threads to its two CPUs; none for
    workers sharing CPUs (passive wait), unpinned ones, tensor-parallel ones, or when the user
    binds threads himself."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    for name in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    spawned = {}

    def popen(argv, env=None, **kw):
        spawned[argv[argv.index("--worker-id") + 1]] = env
        raise OSError("not started: this test only reads the environment")

    monkeypatch.setattr("subprocess.Popen", popen)

    def envs(**kw):
        spawned.clear()
        c = Cluster(LauncherConfig(log_dir=str(tmp_path), **kw))
        for w in c.workers:
            with pytest.raises(OSError):
                c._spawn(w)
        return {n: (e.get("OMP_PLACES"), e.get("OMP_PROC_BIND")) for n, e in spawned.items()}

    assert envs(cpu_affinity=(0, 1)) == {"prefill-0": ("{0},{1}", "close"), "decode-0": ("{1},{0}", "close")}
    assert envs(cpu_affinity=(0, 1), num_prefill=0, serving_mode="colocated", threads=2) == {
        "decode-0": ("{0},{1}", "close")}
    none = (None, None)
    assert envs(cpu_affinity=(0, 1), threads=2) == {"prefill-0": none, "decode-0": none}   # sharing: passive
    assert envs() == {"prefill-0": none, "decode-0": none}                                   # unpinned
    assert envs(cpu_affinity=(0, 1, 2), decode_tp=(2,))["decode-0"] == none
    monkeypatch.setenv("OMP_PLACES", "cores")   # the user's binding wins
    assert envs(cpu_affinity=(0, 1)) == {"prefill-0": ("cores", None), "decode-0": ("cores", None)}
