"""``pytest -m rdma`` on a real RDMA stack wherever pytest runs.

On a host with an RDMA device, or inside the lab's guest, rdma-marked tests run as they are. On
any other host each selected rdma test is replaced by a proxy item, and the proxies move to the
end of the run. Before the first host test that is not marked ``e2e`` (whose clusters keep both
cores busy; the other tiers mostly leave one idle), a thread named ``rdma-lab`` boots the lab
once (:mod:`rdmalab`) and runs every selected rdma test inside it in one pytest session, in the
background while the host's own tests go on (``PDSERVE_LAB_BACKGROUND=0``, or a selection with
no such test: the lab starts when the first proxy runs, as the only work). The guest's pytest
writes one JSON line per test phase to the shared outbox; each proxy waits for the lab, then
reports its own test's outcome, failure text and skip reason from there. A lab that cannot boot
makes every proxy call ``tests.require.unavailable("rdma-lab", reason)``: a skip on a laptop, a
failure where ``PDSERVE_REQUIRE`` lists ``rdma-lab`` (CI). The session's end stops a lab still
running (the guest is killed) and joins the thread.

A plugin of ``tests/conftest.py`` (``pytest_plugins``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

REPORT_NAME = "pytest-report.jsonl"
_FORWARDED_ENV = ("PDSERVE_REQUIRE", "PDSERVE_LAB_TP_MODEL")


def _device_here() -> bool:
    try:
        from kvtransfer.verbs.support import rdma_device_available
        return rdma_device_available()
    except Exception:   # noqa: BLE001 - no pyverbs, no device: not here
        return False


class LabRun:
    """One lab boot running ``nodeids``, on a thread named ``rdma-lab``.

    ``start()`` begins it in the background; ``result(nodeid)`` waits for it (starting it first if
    nothing did) and returns that test's folded outcome, or None (``error`` then says why, or the
    guest never reported that test). ``stop()`` kills a guest still running and joins the thread.
    ``config`` (an ``rdmalab.config.LabConfig``) defaults to ``LabConfig.from_env()``; ``outbox``
    to its cache directory's ``outbox``, emptied before the guest starts. The guest's pytest
    output goes to ``last-pytest.log`` beside the outbox.
    """

    def __init__(self, nodeids: list[str], rootdir: Path, config=None, outbox: Path | None = None) -> None:
        self.nodeids = nodeids
        self.rootdir = rootdir
        self.config = config
        self.outbox = outbox
        self.results: dict[str, dict] | None = None
        self.error: str | None = None
        self.summary = ""
        self.log_path: Path | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._guest = None        # the running rdmalab.guest.Guest, for stop()
        self._stopped = False

    def start(self) -> None:
        """Boot the lab and run the tests on the ``rdma-lab`` thread (no-op once started)."""
        with self._lock:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(target=self._guarded_run, name="rdma-lab", daemon=True)
            self._thread.start()

    def result(self, nodeid: str) -> dict | None:
        self.start()
        assert self._thread is not None or self._stopped
        if self._thread is not None:
            self._thread.join()
        if self.results is None and self.error is None:
            self.error = "the RDMA lab was stopped before it finished"
        return None if self.results is None else self.results.get(nodeid)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Kill the guest if it still runs and join the thread; later ``result`` calls see an error."""
        with self._lock:
            self._stopped = True
            guest = self._guest
        if guest is not None:
            guest.close()
        if self._thread is not None:
            self._thread.join()

    def _guarded_run(self) -> None:
        try:
            self._run()
        except Exception as exc:   # noqa: BLE001 - every proxy reports it, none hangs
            self.error = f"the RDMA lab's runner failed: {exc!r}"

    def _run(self) -> None:
        from rdmalab.assets import prepare
        from rdmalab.config import LabConfig, run_timeout_s
        from rdmalab.errors import LabError, LabUnavailable
        from rdmalab.guest import Guest

        config = self.config or LabConfig.from_env()
        outbox = self.outbox or config.cache_dir / "outbox"
        self.log_path = outbox.parent / "last-pytest.log"
        try:
            assets = prepare(config)
        except LabUnavailable as exc:
            self.error = f"the RDMA lab cannot boot here: {exc}"
            return
        if outbox.exists():
            for old in outbox.iterdir():
                old.unlink()
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--color=no", "--durations=30",
                *self.nodeids]
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        started = time.monotonic()
        with open(self.log_path, "w") as log:   # the guest's pytest output, as it arrives
            guest = Guest(config, assets, argv, env=env, outbox=outbox,
                          echo=lambda line: (log.write(line), log.flush()))
            with self._lock:   # stop() either sees this guest started or finds _stopped set here
                if self._stopped:
                    self.error = "the RDMA lab was stopped before it booted"
                    return
                self._guest = guest.start()
            try:
                result = guest.wait(run_timeout_s())
            except LabError as exc:
                output = getattr(exc, "output", "")
                self.error = f"the RDMA lab failed: {exc}; log {self.log_path}\n{output[-3000:]}"
                return
            finally:
                guest.close()
        self.summary = (f"rdma lab: guest ready after {result.boot_s:.1f}s, {len(self.nodeids)} tests, "
                        f"{time.monotonic() - started:.0f}s in all, pytest exit {result.returncode}; "
                        f"log {self.log_path}")
        self.results = _collect(outbox / REPORT_NAME)
        if not self.results:
            self.error = f"the lab's pytest reported nothing (exit {result.returncode}):\n{result.output[-3000:]}"


def _collect(path: Path) -> dict[str, dict]:
    """node id -> {"outcome", "text", "reason"} folded over its setup/call/teardown phases."""
    results: dict[str, dict] = {}
    if not path.exists():
        return results
    for line in path.read_text().splitlines():
        phase = json.loads(line)
        entry = results.setdefault(phase["nodeid"], {"outcome": "passed", "text": "", "reason": ""})
        if phase["outcome"] == "failed" and entry["outcome"] != "failed":
            entry.update(outcome="failed", text=f"[{phase['when']}] {phase['text']}")
        elif phase["outcome"] == "skipped" and entry["outcome"] == "passed":
            entry.update(outcome="skipped", reason=phase["text"])
    return results


class LabTestFailed(Exception):
    """The test failed inside the lab; the message is its failure text there."""


class LabItem(pytest.Item):
    """Stands in for one rdma test on a host without a device (see the module docstring)."""

    def __init__(self, *, lab: LabRun, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lab = lab

    def runtest(self) -> None:
        result = self.lab.result(self.nodeid)
        if self.lab.error is not None:
            from tests.require import unavailable
            unavailable("rdma-lab", self.lab.error)
        if result is None:
            raise LabTestFailed(f"no result from the lab for {self.nodeid} (see {self.lab.log_path})")
        if result["outcome"] == "skipped":
            pytest.skip(f"in the lab: {result['reason']}")
        if result["outcome"] == "failed":
            raise LabTestFailed(result["text"])

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, LabTestFailed):
            return f"failed inside the RDMA lab:\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"[rdma lab] {self.name}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    from rdmalab.config import in_lab, run_timeout_s

    rdma = [item for item in items if item.get_closest_marker("rdma") is not None]
    if not rdma or in_lab() or _device_here():
        return
    lab = LabRun([item.nodeid for item in rdma], Path(str(config.rootpath)))
    config.stash[_LAB] = lab
    proxies = {}
    for item in rdma:
        proxy = LabItem.from_parent(item.parent, name=item.name, nodeid=item.nodeid, lab=lab)
        proxy.own_markers.extend(item.iter_markers())
        proxy.keywords.update({mark.name: mark for mark in item.iter_markers()})
        proxy.add_marker(pytest.mark.timeout(run_timeout_s() + 120))
        proxies[item.nodeid] = proxy
    # the host's tests first: the lab runs beside them and the proxies collect its results last
    items[:] = [item for item in items if item.nodeid not in proxies] + [proxies[item.nodeid] for item in rdma]


def background() -> bool:
    """Whether the lab runs beside the host's tests (``PDSERVE_LAB_BACKGROUND``, default 1)."""
    value = os.environ.get("PDSERVE_LAB_BACKGROUND", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_LAB_BACKGROUND must be 0 or 1, got {value!r}")
    return value == "1"


def pytest_runtest_setup(item):
    """Start the lab in the background before the first host test that is not an e2e one: the
    e2e tier's clusters keep both cores busy, the other tiers leave one mostly idle."""
    lab = item.config.stash.get(_LAB, None)
    if lab is not None and background() and item.get_closest_marker("e2e") is None:
        lab.start()


def pytest_sessionfinish(session, exitstatus):
    lab = session.config.stash.get(_LAB, None)
    if lab is not None:
        lab.stop()


_LAB = pytest.StashKey[LabRun]()


def pytest_runtest_logreport(report):
    """Inside the lab: one JSON line per phase into the outbox, for the host's proxies."""
    from rdmalab.config import guest_outbox

    outbox = guest_outbox()
    if outbox is None:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    else:
        text = report.longreprtext if report.failed else ""
    with open(outbox / REPORT_NAME, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "text": text[-20000:]}) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lab = config.stash.get(_LAB, None)
    if lab is not None and lab.summary:
        terminalreporter.write_line(lab.summary)
