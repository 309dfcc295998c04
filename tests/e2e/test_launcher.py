"""`pdserve up` as a user runs it (stops cleanly on SIGTERM, exit 0, no process left), and the
launcher's error when a worker does not come up."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploy.launcher import Cluster, LauncherConfig, LaunchError, free_port
from tests.e2e.conftest import openai_client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def _read_lines(proc: subprocess.Popen, lines: queue.Queue) -> None:
    """``proc``'s stdout lines into ``lines``, then None at its end."""
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def _next_line(lines: queue.Queue, proc: subprocess.Popen, seen: list[str], timeout_s: float) -> str:
    """The next line ``proc`` printed; fails the test, with what it printed, when it printed
    nothing for ``timeout_s`` or exited."""
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        pytest.fail(f"pdserve up printed nothing for {timeout_s:g} s; its output so far:\n{''.join(seen)}")
    if line is None:
        pytest.fail(f"pdserve up exited with code {proc.wait()}; its output:\n{''.join(seen)}")
    return line


@pytest.mark.timeout(900)   # a first start on a new machine builds its kernels (up to 660 s here)
def test_pdserve_up_serves_and_stops_cleanly_on_sigterm(tmp_path):
    """README's run command, on the default model under a file name of its own: the model is
    served under that name and ``--ask`` asks it (the name ``/v1/models`` lists); the decode worker
    attends through the compiled kernel (``--attention-backend auto``)."""
    from engine.modelfile import default_model_path

    model = tmp_path / "models" / "my-smollm2.gguf"
    model.parent.mkdir()
    model.symlink_to(default_model_path())
    http_port, registry_port = free_port(), free_port()
    argv = [sys.executable, "-m", "deploy.cli", "up", "--http-port", str(http_port),
            "--registry-port", str(registry_port), "--num-blocks", "256", "--log-dir", str(tmp_path),
            "--model", str(model), "--ask", "What is the capital of France?"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc, lines), name="up-stdout", daemon=True).start()
    try:
        seen = []
        # a first start on a new machine builds and times its kernels before "up" (pdserve up's
        # own --startup-timeout bounds it: 600 s by default)
        while not any("pdserve is up" in l for l in seen):
            seen.append(_next_line(lines, proc, seen, timeout_s=660))
        assert f"http://127.0.0.1:{http_port}/v1" in seen[-1]
        while not any("Paris" in l for l in seen):  # README's run command answers a request
            seen.append(_next_line(lines, proc, seen, timeout_s=120))

        class _C:
            url = f"http://127.0.0.1:{http_port}"
        r = openai_client(_C).chat.completions.create(
            model="my-smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1
        assert len(_processes_mentioning(f"127.0.0.1:{registry_port}")) == 3  # router + 2 workers
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:   # a CPU of its own each, lent to the other while it waits for work
            workers = sorted(set(_processes_mentioning("--cpu-board"))
                             & set(_processes_mentioning(f"127.0.0.1:{registry_port}")))
            assert len(workers) == 2 and (tmp_path / "cpu-board").exists()
            mains = [re.search(r"^Cpus_allowed_list:\s*(\S+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
                     .group(1) for pid in workers]
            assert sorted(mains) == [str(cpus[0]), str(cpus[1])]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _processes_mentioning(f"127.0.0.1:{registry_port}") == []
    assert {p.name for p in tmp_path.iterdir()} >= {"router.log", "prefill-0.log", "decode-0.log"}
    # the default decode attention reads the pool through the block table (auto: a C++ compiler is
    # here, as on every machine of this project); the prefill worker builds no such kernel
    assert "decode attention: compiled" in (tmp_path / "decode-0.log").read_text()
    assert "decode attention" not in (tmp_path / "prefill-0.log").read_text()


def test_worker_that_does_not_come_up_is_named_with_its_log(tmp_path):
    config = LauncherConfig(http_port=0, registry_port=0, weights="fp32", log_dir=str(tmp_path), startup_timeout_s=120,
                            worker_args=("--max-num-seqs", "0"))
    cluster = Cluster(config)
    with pytest.raises(LaunchError) as err:
        cluster.start()
    message = str(err.value)
    assert "exited with code" in message and ("prefill-0" in message or "decode-0" in message)
    assert "max_num_seqs" in message  # the log tail carries the worker's own error
    assert not any(c.alive() for c in cluster.children)


def test_dead_decode_worker_is_removed_and_requests_go_to_the_survivor(tmp_path):
    import time

    import httpx

    from tests.e2e.conftest import assert_pools_full, start_cluster, stop_cluster

    cluster = start_cluster(tmp_path, num_prefill=1, num_decode=2, transfer_engine="tcp",
                            router_args=("--dead-after-s", "3"))
    try:
        victim = next(c for c in cluster.workers if c.name == "decode-0")
        victim.popen.send_signal(signal.SIGKILL)  # no Leave: only missed heartbeats tell
        victim.popen.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ids = {m["id"] for m in httpx.get(f"{cluster.url}/admin/workers", timeout=5).json()}
            if "decode-0" not in ids:
                break
            time.sleep(0.5)
        assert ids == {"prefill-0", "decode-1"}
        client = openai_client(cluster)
        for _ in range(3):
            r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=4,
                                          temperature=0)
            assert r.usage.completion_tokens == 4
        assert_pools_full(cluster, num_workers=2)
    finally:
        stop_cluster(cluster)
