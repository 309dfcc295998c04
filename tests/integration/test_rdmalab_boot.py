"""The RDMA lab boots, runs a command with two Soft-RoCE devices up, returns its exit status and
output, and kills the guest when the command runs out of time; a lab run in the background (as
pytest runs the rdma tests beside the host's) stops with its guest and thread."""

from __future__ import annotations

import threading
import time

import pytest

from rdmalab.config import LabConfig, in_lab
from rdmalab.errors import LabTimeout, LabUnavailable
from rdmalab.guest import Guest, run
from tests.require import unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def lab():
    if in_lab():
        pytest.skip("already inside the lab")
    from rdmalab.assets import prepare
    config = LabConfig.from_env(memory_mib=1024)
    try:
        return config, prepare(config)
    except LabUnavailable as exc:
        unavailable("rdma-lab", str(exc))


def test_runs_a_command_with_two_rxe_devices_and_returns_its_status(lab):
    config, assets = lab
    result = run(config, assets, ["sh", "-c", "echo hello; rdma link show; exit 7"], timeout_s=300)
    assert result.returncode == 7
    assert "hello" in result.output
    assert "rxe0/1 state ACTIVE" in result.output and "netdev veth0" in result.output
    assert "rxe1/1 state ACTIVE" in result.output and "netdev veth1" in result.output
    assert 0 < result.boot_s < result.wall_s


def _consoles() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "rdmalab-console"}


def test_guest_is_killed_when_the_command_runs_out_of_time(lab):
    """The deadline counts from the start, boot included; here it falls 10 s after the guest is
    ready (a boot takes seconds, tens beside the background lab of a whole pytest run)."""
    config, assets = lab
    before = _consoles()
    started = time.monotonic()
    guest = Guest(config, assets, ["sleep", "600"]).start()
    try:
        assert guest.wait_ready(300), guest.output()
        ready = time.monotonic()
        with pytest.raises(LabTimeout):
            guest.wait(timeout_s=ready - started + 10)
        assert time.monotonic() - ready < 60
        assert not guest.running()
    finally:
        guest.close()
    assert not _consoles() - before
    assert not guest.outbox.exists()


def test_a_background_lab_run_stops_with_its_guest_and_thread(lab, tmp_path):
    """The session's end stops a lab still running beside the host's tests (tests/lab_runner.py):
    the guest is killed, the ``rdma-lab`` thread ends and every proxy sees an error."""
    from tests.lab_runner import LabRun

    config, _ = lab
    run_ = LabRun(["tests/integration/test_rdmalab_boot.py"], tmp_path, config=config, outbox=tmp_path / "outbox")
    run_.start()
    assert run_._thread is not None and run_._thread.name == "rdma-lab"
    deadline = time.monotonic() + 120
    while (run_._guest is None or not run_._guest.running()) and time.monotonic() < deadline:
        assert run_.running(), run_.error
        time.sleep(0.2)
    guest = run_._guest
    assert guest is not None and guest.running()
    run_.stop()
    assert not run_.running() and not guest.running()
    assert run_.result("tests/integration/test_rdmalab_boot.py") is None
    assert run_.error and "failed" in run_.error
    assert (tmp_path / "last-pytest.log").exists()
