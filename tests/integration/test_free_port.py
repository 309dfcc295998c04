"""`deploy.launcher.free_port`: ports for a process started next to bind."""

from __future__ import annotations

import socket

import pytest

from deploy.launcher import free_port

pytestmark = pytest.mark.integration


def test_free_port_is_bindable_and_below_the_kernels_ephemeral_range():
    """Below ``ip_local_port_range``, so a kernel-chosen port (port-0 listeners, outgoing
    connections) can never take it before its process binds."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < ephemeral_low for p in ports)
    assert len(ports) > 1   # random picks, not one fixed port
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
