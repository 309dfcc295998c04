"""`worker.runtime.bound_native_memory`: the prefill worker's kernel caches are bounded, the
decode worker's left alone, and values already in the environment win; and a worker is built on
a thread of its own that ends before it serves (`worker.runtime.run_on_own_thread`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from worker.config import WorkerConfig
from worker.runtime import PREFILL_KERNEL_CACHE, bound_native_memory, run_on_own_thread, serve

pytestmark = pytest.mark.unit

NAMES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_prefill_bounds_both_caches(clean_env):
    bound_native_memory("prefill")
    assert [os.environ[n] for n in NAMES] == [str(PREFILL_KERNEL_CACHE)] * 2


def test_decode_is_left_alone(clean_env):
    bound_native_memory("decode")
    assert not any(n in os.environ for n in NAMES)


def test_the_environment_wins(clean_env):
    clean_env.setenv("LRU_CACHE_CAPACITY", "512")
    bound_native_memory("prefill")
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(PREFILL_KERNEL_CACHE)


# -- one OpenMP team per worker (`worker.runtime.run_on_own_thread`) ------------------------------

def test_run_on_own_thread_returns_from_a_thread_that_has_ended():
    seen = []

    def build(x):
        seen.append(threading.current_thread())
        return x * 2

    assert run_on_own_thread("worker-build", build, 21) == 42
    assert seen[0] is not threading.current_thread() and seen[0].name == "worker-build"
    assert not seen[0].is_alive()


def test_run_on_own_thread_raises_what_the_thread_raised():
    def build():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        run_on_own_thread("worker-build", build)


def test_serve_builds_the_worker_off_the_main_thread():
    """The model is loaded (and its OpenMP team made) on a thread that ends before serving."""
    names = []

    class Stop(Exception):
        pass

    def build(config):
        names.append(threading.current_thread().name)
        raise Stop

    with pytest.raises(Stop):
        serve(WorkerConfig(role="decode"), build)
    assert names == ["worker-build"]


_TEAMS = """
import os, threading, time, torch
from worker.runtime import run_on_own_thread
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
work = lambda: torch.ones(1 << 22).mul_(2).sum().item()
before = tasks()
run_on_own_thread("worker-build", work)
deadline = time.monotonic() + 5
while tasks() > before and time.monotonic() < deadline:   # the team's threads exit after it
    time.sleep(0.01)
after_own = tasks()
work()
print(before, after_own, tasks())
"""


def test_a_parallel_build_on_its_own_thread_leaves_no_openmp_team_behind():
    """The build's OpenMP worker threads end with its thread; the same work on the main thread
    leaves a team (one more thread) alive for the process's life."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: with one, torch runs no team")
    out = subprocess.run([sys.executable, "-c", _TEAMS], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout.split()
    before, after_own, after_main = map(int, out)
    assert after_own == before
    assert after_main > before
