"""``pytest -m rdma`` on a real RDMA stack wherever pytest runs.

On a host with an RDMA device, or inside the lab's guest, rdma-marked tests run as they are. On
any other host each selected rdma test is replaced by a proxy item; the first proxy to run
boots the lab once (:mod:`rdmalab`) and runs every selected rdma test inside it in one pytest
session, which writes one JSON line per test phase to the shared outbox; each proxy then
reports its own test's outcome, failure text and skip reason from there. A lab that cannot boot
makes every proxy call ``tests.require.unavailable("rdma-lab", reason)``: a skip on a laptop, a
failure where ``PDSERVE_REQUIRE`` lists ``rdma-lab`` (CI).

Hooks are re-exported by ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import sys
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
    """One lab boot running ``nodeids``; results by node id once :meth:`result` first ran it."""

    def __init__(self, nodeids: list[str], rootdir: Path) -> None:
        self.nodeids = nodeids
        self.rootdir = rootdir
        self.results: dict[str, dict] | None = None
        self.error: str | None = None
        self.summary = ""
        self.log_path: Path | None = None

    def result(self, nodeid: str) -> dict | None:
        if self.results is None and self.error is None:
            self._run()
        return None if self.results is None else self.results.get(nodeid)

    def _run(self) -> None:
        from rdmalab.assets import prepare
        from rdmalab.config import LabConfig, run_timeout_s
        from rdmalab.errors import LabError, LabUnavailable
        from rdmalab.guest import Guest

        config = LabConfig.from_env()
        outbox = config.cache_dir / "outbox"
        self.log_path = config.cache_dir / "last-pytest.log"
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
            try:
                with Guest(config, assets, argv, env=env, outbox=outbox,
                           echo=lambda line: (log.write(line), log.flush())) as guest:
                    result = guest.wait(run_timeout_s())
            except LabError as exc:
                output = getattr(exc, "output", "")
                self.error = f"the RDMA lab failed: {exc}; log {self.log_path}\n{output[-3000:]}"
                return
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
    items[:] = [proxies.get(item.nodeid, item) for item in items]


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
