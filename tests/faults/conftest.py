"""The fault lab: a cluster spread over network namespaces (see netlab.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults.netlab import Host, NetLab, NetLabUnavailable, wait_for
from tests.require import unavailable

HTTP_PORT, REGISTRY_PORT, WORKER_PORT, TRANSFER_PORT = 8000, 50050, 50051, 50061
ROUTER_FLAGS = ("--dead-after-s", "3", "--heartbeat-interval-s", "0.5", "--max-attempts", "4",
                "--queue-timeout-s", "30", "--prefill-timeout-s", "20", "--policy", "kv")
WORKER_FLAGS = ("--transfer-engine", "tcp", "--num-blocks", "512", "--heartbeat-interval-s", "0.5",
                "--prefill-timeout-s", "15", "--quarantine-s", "20", "--transfer-timeout-s", "20",
                "--prefix-caching")   # caching on: retries and migrations reuse cached prefixes


@dataclass
class FaultCluster:
    """Router, workers and a client, each in its own namespace."""

    lab: NetLab
    logs: Path
    router_host: Host = None
    client: Host = None
    workers: dict = field(default_factory=dict)   # name -> (host, role, Popen)
    router_proc: subprocess.Popen = None

    @property
    def url(self) -> str:
        return f"http://{self.router_host.address}:{HTTP_PORT}"

    def start_router(self) -> None:
        argv = [sys.executable, "-m", "router", "--http-host", self.router_host.address, "--http-port",
                str(HTTP_PORT), "--registry-address", f"{self.router_host.address}:{REGISTRY_PORT}", *ROUTER_FLAGS]
        self.router_proc = self.lab.run(self.router_host, argv, self.logs / "router.log")

    def start_worker(self, name: str, role: str) -> subprocess.Popen:
        host = self.lab.hosts.get(name) or self.lab.add_host(name)
        argv = [sys.executable, "-m", role, "--router", f"{self.router_host.address}:{REGISTRY_PORT}",
                "--listen", f"{host.address}:{WORKER_PORT}", "--transfer-port", str(TRANSFER_PORT),
                "--worker-id", name, *WORKER_FLAGS]
        proc = self.lab.run(host, argv, self.logs / f"{name}.log")
        self.workers[name] = (host, role, proc)
        return proc

    def in_client(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.client.netns, *argv], capture_output=True,
                              text=True, timeout=timeout)

    def probe(self) -> dict:
        res = self.in_client([sys.executable, "-m", "tests.faults.probe", "--url", self.url])
        if res.returncode != 0:
            return {}
        return json.loads(res.stdout)

    def connected(self) -> dict[str, str]:
        return {wid: w.get("state") for wid, w in self.probe().get("workers", {}).items()}

    def wait_connected(self, names: set[str], timeout_s: float = 240) -> None:
        def ready():
            self.check_alive()
            states = self.connected()
            return all(states.get(n) == "CONNECTED" for n in names)
        wait_for(ready, timeout_s, f"workers {sorted(names)} CONNECTED")

    def check_alive(self) -> None:
        for name, (_, _, proc) in self.workers.items():
            if getattr(proc, "expected_exit", False):
                continue
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{tail}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
        proc = self.workers[name][2]
        proc.expected_exit = True
        proc.send_signal(sig)
        return proc

    def start_client(self, requests: list[dict], interval: float, tag: str) -> tuple[subprocess.Popen, Path]:
        req_file, out_file = self.logs / f"{tag}-requests.json", self.logs / f"{tag}-results.json"
        req_file.write_text(json.dumps(requests))
        argv = [sys.executable, "-m", "tests.faults.stream_client", "--url", self.url, "--requests",
                str(req_file), "--out", str(out_file), "--interval", str(interval), "--concurrency", "8"]
        return self.lab.run(self.client, argv, self.logs / f"{tag}-client.log"), out_file


@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("faults")
    try:
        lab = NetLab("pdf")
    except NetLabUnavailable as exc:
        unavailable("netns", f"network namespaces unavailable: {exc}")
    cluster = FaultCluster(lab, logs)
    try:
        cluster.router_host = lab.add_host("router")
        cluster.client = lab.add_host("client")
        cluster.start_router()
        for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"),
                           ("decode-1", "decode")):
            cluster.start_worker(name, role)
        cluster.wait_connected({"prefill-0", "prefill-1", "decode-0", "decode-1"})
        yield cluster
    finally:
        lab.close()
