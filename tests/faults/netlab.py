"""Several hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

Topology: a "switch" namespace holds the bridge; every host is its own namespace with one veth
into the switch and an address 10.<net>.0.<n>/24. Nothing is added to the caller's namespace, so
no traffic can leave the lab: test traffic goes only to addresses of namespaces this lab made.
Processes run in a host with ``ip netns exec`` (which execs the program, so the Popen's pid is
the program itself and kill -9 hits it directly).

Needs root and iproute2. `NetLab.close` kills every process it started and deletes every
namespace; it is idempotent.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


class NetLabUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2, no veth support)."""


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise NetLabUnavailable(f"ip {' '.join(args)}: {res.stderr.strip()}")


@dataclass
class Host:
    """One namespace with one address."""

    name: str
    netns: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class NetLab:
    """A lab of hosts. ``net`` picks the 10.<net>.0.0/24 subnet (keep labs apart)."""

    def __init__(self, prefix: str, net: int = 77):
        if os.geteuid() != 0:
            raise NetLabUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetLabUnavailable("iproute2 ('ip') is not installed")
        self.prefix = f"{prefix}{os.getpid() % 10000}"
        self.net = net
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._make_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _make_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace wired to the bridge, with the next free address."""
        n = len(self.hosts) + 1
        ns = f"{self.prefix}-{name}"
        self._make_ns(ns)
        inside, outside = f"v{n}", f"{self.prefix[-6:]}s{n}"[:15]
        _ip("link", "add", inside, "netns", ns, "type", "veth", "peer", "name", outside, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", outside, "master", "br0")
        _ip("-n", self.switch, "link", "set", outside, "up")
        address = f"10.{self.net}.0.{n}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        host = Host(name, ns, address)
        self.hosts[name] = host
        return host

    def run(self, host: Host, argv: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; output goes to ``log_path``."""
        log = open(log_path, "ab")
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        log.close()
        host.procs.append(proc)
        return proc

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in host.procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()
        self.hosts.clear()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.3):
    """Poll ``predicate`` until truthy; raises TimeoutError naming ``what``."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
