"""``python -m loadtest.peers`` as a user runs it, against real servers on 127.0.0.1.

The servers are the OpenAI test double of ``test_loadtest_harness.py`` (that file run as a
script): one started by ``loadtest.peers`` itself through ``--command``, one started here and
passed as ``--url``. pdserve itself is not started (``--no-pdserve``): it goes through
``loadtest.compare.Server``, which other tests cover.
"""

import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = Path(__file__).with_name("test_loadtest_harness.py")
FAST = ["--ttft-ms", "20", "--itl-ms", "5"]  # the double's delays, ms
SMALL = ["--concurrency", "1,2", "--num-prompts", "2,4", "--output-len", "4", "--input-len", "16",
         "--startup-timeout", "60", "--max-duration", "60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def double_url():
    """A test double this test starts and stops itself (the ``--url`` server)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(DOUBLE), "--port", str(port), *FAST])
    try:
        deadline = time.monotonic() + 30
        while not _accepts(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("test double did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _peers(*argv: str, result_dir: Path | None = None) -> subprocess.CompletedProcess:
    extra = ["--result-dir", str(result_dir)] if result_dir else []
    return subprocess.run([sys.executable, "-m", "loadtest.peers", *argv, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def _record(result_dir: Path) -> dict:
    (path,) = result_dir.glob("peers-*.json")
    return json.loads(path.read_text())


def test_runs_a_command_and_a_url_at_every_level(double_url, tmp_path):
    """The --command server lists its model before it can serve (``/health`` 503 for its first
    3 s, as a pdserve router before its workers join): it is run once ready, not failed."""
    command = shlex.join([sys.executable, str(DOUBLE), *FAST, "--unready-s", "3"]) + " --port {port}"
    proc = _peers("--no-pdserve", "--command", f"fake={command}", "--url", f"there={double_url}",
                  *SMALL, result_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = _record(tmp_path)
    assert list(record["runs"]) == ["fake", "there"]
    for name in ("fake", "there"):
        for level, num in (("1", 2), ("2", 4)):
            result = record["runs"][name][level]["result"]
            assert result["completed"] == num and result["failed"] == 0, (name, level)
            assert result["output_lens"] == [4] * num
            assert result["max_concurrency"] == int(level) and result["model_id"] == "fake-model"
            assert result["endpoint"] == "/v1/chat/completions"
            assert f"| {level} | {name} | {num} / 0 |" in proc.stdout
            assert any(line.startswith(f"| {level} | {name} | {num} / 0 |") for line in record["table"])
    assert "| 4.0 |" in proc.stdout  # mean output tokens per request
    assert "pdserve vs each peer" not in proc.stdout  # no pdserve, no ratios
    assert record["machine"]["nproc"] >= 1 and set(record["machine"]["flags"]) == {
        "avx2", "avx512f", "amx"}
    # the --command server got a free port in place of {port}, and is gone after exit
    argv = record["runs"]["fake"]["1"]["command"]
    port = int(argv[-1].split("--port ")[1].split()[0])
    assert not _accepts(port)
    assert (tmp_path / f"peers-{record['date']}-fake.log").exists()
    assert _accepts(int(double_url.rsplit(":", 1)[1]))  # a --url server is left running


def test_a_failed_server_does_not_stop_the_others(double_url, tmp_path):
    dies = shlex.join([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    proc = _peers("--no-pdserve", "--command", f"broken={dies}", "--url", f"good={double_url}",
                  "--url", f"nobody=http://127.0.0.1:{_free_port()}", *SMALL, result_dir=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "broken: did not start: exited with code 3" in proc.stderr
    assert "no model here" in proc.stderr  # the failed server's log tail
    assert "nobody: http://127.0.0.1:" in proc.stderr and "is not reachable" in proc.stderr
    record = _record(tmp_path)
    assert record["runs"]["broken"] == {} and record["runs"]["nobody"] == {}
    assert set(record["errors"]) == {"broken", "nobody"}
    for level, num in (("1", 2), ("2", 4)):
        assert record["runs"]["good"][level]["result"]["completed"] == num
    assert "| 1 | broken | error |" in proc.stdout and "| 2 | good | 4 / 0 |" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,2", "--num-prompts", "4"], "--num-prompts needs one value per --concurrency"),
    (["--url", "nameless"], "--url wants NAME=URL"),
    (["--url", "x=127.0.0.1:8000"], "must start with http:// or https://"),
    (["--command", "a=true", "--command", "a=false"], "server name 'a' is used twice"),
    (["--no-pdserve"], "nothing to run"),
])
def test_bad_arguments_exit_2(argv, message, tmp_path):
    proc = _peers(*argv, result_dir=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
