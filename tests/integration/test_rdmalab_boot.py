"""The RDMA lab boots, runs a command with two Soft-RoCE devices up, returns its exit status and
output, and kills the guest when the command runs out of time."""

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


def test_guest_is_killed_when_the_command_runs_out_of_time(lab):
    config, assets = lab
    guest = Guest(config, assets, ["sleep", "600"]).start()
    try:
        started = time.monotonic()
        with pytest.raises(LabTimeout):
            guest.wait(timeout_s=25)   # the guest boots in ~10 s; then sleep 600 runs out
        assert time.monotonic() - started < 90
        assert not guest.running()
    finally:
        guest.close()
    assert not [t for t in threading.enumerate() if t.name == "rdmalab-console"]
    assert not guest.outbox.exists()
