"""`engine.aot_kernel`'s build lock, with a second real process holding it: a package another
process is building is waited for and loaded, never built twice; under `defer_busy` the caller is
told at once (`PackageBusy`) and builds nothing; and a worker's warm-up over several thread counts
(`worker.kernels._warm_counts`) goes on to the counts after a busy one, coming back for it once
nothing else is left. One tiny package (x + 1) is built, in the child process; its bytes serve as
the other packages, copied into place as a build renames its output."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.aot_kernel import PackageBusy, cache_dir, defer_busy, load_or_build, package_key

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__)


class _AddOne(torch.nn.Module):
    def forward(self, x):
        return (x + 1,)


def _export():
    return torch.export.export(_AddOne(), (torch.zeros(3),))


def _path(name: str, threads: int) -> Path:
    """Where `load_or_build` keeps package ``name`` (no parameters, this file as its source) built
    on ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cache_dir() / f"{name}-{package_key(name, {}, [SOURCE])}.pt2"
    finally:
        torch.set_num_threads(before)


def _child(code: str) -> subprocess.Popen:
    """A Python process running ``code`` from the checkout with this test's cache directory; it
    prints "holding" once it holds what it must, and reads its standard input before it lets go."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _wait_for(line: str, child: subprocess.Popen) -> None:
    got = child.stdout.readline().strip()
    assert got == line, f"the child said {got!r}, exit code {child.poll()}"


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory) -> Path:
    """This module's own cache directory (``TORCHINDUCTOR_CACHE_DIR``, which `cache_dir` reads),
    empty at first."""
    directory = tmp_path_factory.mktemp("inductor")
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))
    yield directory
    mp.undo()


def test_a_package_being_built_elsewhere_is_deferred_or_waited_for_and_loaded():
    path = _path("lock_probe", 1)
    child = _child("""
        import sys, torch
        torch.set_num_threads(1)
        from engine.aot_kernel import load_or_build
        from tests.unit.test_aot_build_lock import SOURCE, _export
        def export():   # called with the package's build lock held
            print("holding", flush=True)
            sys.stdin.readline()
            return _export()
        print("built" if load_or_build("lock_probe", {}, [SOURCE], export).built else "loaded", flush=True)
    """)
    try:
        _wait_for("holding", child)
        calls = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with defer_busy(), pytest.raises(PackageBusy, match="being built by another process"):
                load_or_build("lock_probe", {}, [SOURCE], lambda: calls.append(1))
            assert not calls and not path.exists()
            got = []
            waiter = threading.Thread(target=lambda: got.append(load_or_build("lock_probe", {}, [SOURCE],
                                                                               lambda: calls.append(1))),
                                      name="test-aot-waiter")
            waiter.start()
            time.sleep(0.5)
            assert waiter.is_alive() and not got   # waiting for the child's build
            child.stdin.write("go\n")
            child.stdin.flush()
            waiter.join(timeout=300)
            assert not waiter.is_alive()
        finally:
            torch.set_num_threads(threads)
        _wait_for("built", child)
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()
    (package,) = got
    assert not calls and not package.built and package.path == path
    assert torch.equal(package(torch.zeros(3))[0], torch.ones(3))


class _Kernel:
    """What `worker.kernels._warm_counts` reads of a kernel: ``packages``, those it loaded."""

    def __init__(self):
        self.packages = {}


class _Model:
    """A model whose ``warm_up`` loads package "warm_probe" for the current thread count through
    `load_or_build` (its build refused: every package this test needs is on disk or being put
    there), recording the thread count of each call and how it ended."""

    def __init__(self, kernel: _Kernel):
        self.kernel, self.calls = kernel, []

    def warm_up(self, pool) -> float:
        threads = torch.get_num_threads()
        try:
            self.kernel.packages[threads] = load_or_build("warm_probe", {}, [SOURCE], _refused)
        except PackageBusy:
            self.calls.append((threads, "busy"))
            raise
        self.calls.append((threads, "loaded"))
        return 0.0


def _refused():
    raise AssertionError("no package is built here")


def test_a_warm_up_goes_on_past_a_busy_thread_count_and_comes_back_for_it():
    from worker.kernels import _warm_counts

    package = _path("lock_probe", 1)
    assert package.exists(), "the test above builds it"
    one, two = _path("warm_probe", 1), _path("warm_probe", 2)
    shutil.copy(package, two)
    lock = one.with_name(f".{one.stem}.lock")
    # the child builds count 1's package as `load_or_build` does: holds its lock, then renames a
    # finished package into place
    child = _child(f"""
        import fcntl, os, shutil, sys
        with open({str(lock)!r}, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            print("holding", flush=True)
            sys.stdin.readline()
            shutil.copy({str(package)!r}, {str(one) + ".tmp"!r})
            os.replace({str(one) + ".tmp"!r}, {str(one)!r})
    """)
    kernel = _Kernel()
    model = _Model(kernel)
    try:
        _wait_for("holding", child)
        done = threading.Thread(target=_warm_counts, args=(model, None, kernel, [1, 2]), name="test-warm-counts")
        done.start()
        deadline = time.monotonic() + 60
        while model.calls.count((1, "busy")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert done.is_alive()   # now waiting for count 1's build
        child.stdin.write("go\n")
        child.stdin.flush()
        done.join(timeout=60)
        assert not done.is_alive()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()
    # count 1 busy, count 2 loaded; count 1 busy again with nothing else left: waited for, loaded
    assert model.calls == [(1, "busy"), (2, "loaded"), (1, "busy"), (1, "loaded")]
    assert set(kernel.packages) == {1, 2} and not any(p.built for p in kernel.packages.values())
