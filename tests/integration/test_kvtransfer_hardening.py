"""The tcp receiver against hostile or broken writers: a write longer than its region drops the
connection (it used to read forever, or build an unbounded list and OOM the decode worker);
connections still handshaking are capped and get no buffers; the accept loop survives errors.
A real tcp engine receives; raw sockets speak the wire format."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvtransfer import (EngineConfig, ImmediateQueue, MemoryRegion, TransportKind, WriteOp, auth,
                        create_engine)
from kvtransfer.frame import T_WRITE, group_frames
from kvtransfer_helpers import SECRET

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POOL_BYTES = 1 << 20


@pytest.fixture
def rx():
    arrivals = ImmediateQueue()
    pool = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    engine = create_engine("tcp", EngineConfig(secret=SECRET, connect_timeout_s=3.0), arrivals=arrivals)
    key = engine.register_memory(pool).key
    yield engine, pool, key, arrivals
    engine.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kv-tcp")]


def _dial(engine) -> socket.socket:
    addr = engine.describe().transport(TransportKind.TCP)
    return socket.create_connection((addr.host, addr.port), timeout=10)


def _send_frame(sock: socket.socket, ops: list[WriteOp], payload: bytes = b"") -> None:
    [(frame, _)] = group_frames(T_WRITE, [(ops, 1)])
    sock.sendall(frame + payload)


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            if sock.recv(1 << 16) == b"":
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _good_write_lands(engine, pool: torch.Tensor, key: int, arrivals: ImmediateQueue) -> None:
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)[:4096].clone()
    writer = create_engine("tcp", EngineConfig(secret=SECRET))
    try:
        local = writer.register_memory(src)
        peer = writer.connect(engine.describe())
        writer.wait(writer.post_writes(peer, [WriteOp(local, 0, key, 8192, 4096, 0x77)]), 30)
    finally:
        writer.close()
    assert torch.equal(pool[8192:8192 + 4096], src)
    assert arrivals.immediates.get(timeout=5)[0] == 0x77


@pytest.mark.parametrize("case", ["unknown key, 2**62 bytes", "valid key, longer than the region"])
def test_write_longer_than_its_region_drops_the_connection(rx, case):
    engine, pool, key, arrivals = rx
    local = MemoryRegion(0, 1 << 63, 1)   # only the descriptor travels; no payload is sent
    op = (WriteOp(local, 0, key ^ 0x5A5A, 0, 1 << 62, 0x1) if case.startswith("unknown")
          else WriteOp(local, 0, key, 0, POOL_BYTES + 1, 0x1))
    with _dial(engine) as sock:
        auth.client_handshake(sock, SECRET, "hostile-writer")
        t0 = time.monotonic()
        _send_frame(sock, [op])
        assert _closed_by_peer(sock, 10), "the receiver kept reading the oversized payload"
        assert time.monotonic() - t0 < 5
    assert engine.stats().peers_lost >= 1 and not pool.any()
    _good_write_lands(engine, pool, key, arrivals)   # the receiver still serves others


def test_connections_still_handshaking_are_capped(rx):
    engine, pool, key, arrivals = rx
    cap = type(engine).MAX_PREAUTH
    idle = [_dial(engine) for _ in range(cap + 24)]   # connect, never say hello
    try:
        time.sleep(0.5)
        rx_threads = [t for t in threading.enumerate() if t.name.startswith("kv-tcp-rx")]
        assert len(rx_threads) <= cap, f"{len(rx_threads)} receiver threads for unauthenticated sockets"
        closed = sum(_closed_by_peer(s, 0.2) for s in idle[cap:])
        assert closed == len(idle) - cap   # the ones over the cap were closed at once
        assert engine.stats().auth_failures >= len(idle) - cap
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10   # their threads end when the sockets close
    while any(t.name.startswith("kv-tcp-rx") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    _good_write_lands(engine, pool, key, arrivals)


def test_accept_loop_survives_an_exception(rx, monkeypatch):
    engine, pool, key, arrivals = rx
    real = engine._serve_connection
    calls = []

    def failing_once(sock):   # an injected fault: the first accepted connection blows up
        calls.append(sock)
        if len(calls) == 1:
            raise RuntimeError("injected fault in the accept path")
        return real(sock)

    monkeypatch.setattr(engine, "_serve_connection", failing_once)
    with _dial(engine) as sock:
        assert _closed_by_peer(sock, 5)
    listen = [t for t in threading.enumerate() if t.name == "kv-tcp-listen"]
    assert listen and listen[0].is_alive()
    _good_write_lands(engine, pool, key, arrivals)
    assert len(calls) >= 2   # the failed one, then the writer's streams
