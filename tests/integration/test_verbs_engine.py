"""The verbs engine on a real RDMA stack (rdma marker: Soft-RoCE in the lab, or this host's
device): GID and MTU chosen from the port, ``auto`` picks verbs or falls back to tcp with the
reason, the CQ's poll mode, QPs of a lost writer destroyed before ``on_peer_lost``, ``pdserve
doctor``, and the bench's verbs rows. The contract itself: test_kvtransfer_contract.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import pytest
import torch

from kvtransfer import (CompletionCounter, EndpointInfo, EngineConfig, VerbsConfig, WriteOp, create_engine,
                        pack_immediate)
from kvtransfer.verbs.support import list_rdma_devices

pytestmark = [pytest.mark.integration, pytest.mark.rdma, pytest.mark.timeout(900)]
SECRET = b"verbs-engine-test-secret-012345"


def cfg(**verbs) -> EngineConfig:
    return EngineConfig(secret=SECRET, verbs=VerbsConfig(**verbs))


def _roundtrip(tx, rx, counter, nbytes: int = 1 << 20) -> None:
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    region, local = rx.register_memory(dst), tx.register_memory(src)
    info = dataclasses.replace(rx.describe(), host_id="another-host")   # keep auto off shm
    peer = tx.connect(EndpointInfo.from_bytes(info.to_bytes()))
    slot, gen = counter.acquire(30)
    ops = [WriteOp(local, i << 16, region.key, i << 16, 1 << 16, pack_immediate(slot, gen)) for i in range(nbytes >> 16)]
    tx.wait(tx.post_writes(peer, ops), 60)
    counter.expect(slot, gen, len(ops))
    counter.wait(slot, gen, 60)
    assert torch.equal(src, dst)
    counter.release(slot, gen)


def test_port_gid_and_mtu_come_from_the_device():
    """Asked for 4096, the QPs use the port's active MTU (1024 on rxe over 1500-byte Ethernet);
    the GID is a RoCE v2 one, IPv4-mapped where the table has one."""
    from kvtransfer.verbs.engine import VerbsEngine
    from kvtransfer.verbs.support import MTU_BYTES, QP_PATH_MTU

    counter = CompletionCounter(4)
    with VerbsEngine(cfg(mtu=4096), counter) as rx, VerbsEngine(cfg(mtu=4096)) as tx:
        port = rx.device.port
        assert port.state_name == "ACTIVE"
        entry = next(g for g in port.gids if g.index == port.gid_index)
        if port.link_layer_name == "Ethernet":
            assert "v2" in entry.gid_type
            if any(g.ipv4 for g in port.gids):
                assert entry.ipv4 is not None
        _roundtrip(tx, rx, counter)
        (qp,) = tx._loop.leftover_qps()   # noqa: SLF001 - the live QP of the connection
        attr, _ = qp.qp.query(QP_PATH_MTU)
        assert MTU_BYTES[int(attr.path_mtu)] == min(4096, port.active_mtu, tx.device.port.active_mtu)


def test_auto_picks_verbs_when_a_device_is_usable():
    counter = CompletionCounter(4)
    with create_engine("auto", cfg(), arrivals=counter) as rx, create_engine("auto", cfg()) as tx:
        assert rx.primary.name == "verbs" and "GID index" in rx.choice.reason
        _roundtrip(tx, rx, counter)
        assert tx.route(next(iter(tx._routes))) == "verbs"   # noqa: SLF001


@pytest.mark.parametrize("broken", [{"device": "no-such-device"}, {"gid_index": 200}])
def test_auto_falls_back_to_tcp_and_says_why_when_verbs_setup_fails(broken, caplog):
    caplog.set_level(logging.WARNING, logger="kvtransfer.auto")
    counter = CompletionCounter(4)
    with create_engine("auto", cfg(**broken), arrivals=counter) as rx, create_engine("auto", cfg(**broken)) as tx:
        assert rx.primary.name == "tcp" and tx.primary.name == "tcp"
        assert "verbs set-up failed" in rx.choice.reason
        assert any("falling back to tcp" in r.getMessage() for r in caplog.records)
        _roundtrip(tx, rx, counter)   # the worker still serves


def test_cq_poll_mode_moves_data_too():
    counter = CompletionCounter(4)
    with create_engine("verbs", cfg(cq_mode="poll"), arrivals=counter) as rx, \
            create_engine("verbs", cfg(cq_mode="poll")) as tx:
        _roundtrip(tx, rx, counter)


class _Recorder:
    """Arrivals that remember the receiver's QPs when the writer is reported lost."""

    def __init__(self) -> None:
        self.engine = None
        self.immediates = 0
        self.after_loss = 0
        self.qps_at_loss: dict | None = None
        self.lost = threading.Event()

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        self.immediates += count
        if self.lost.is_set():
            self.after_loss += count

    def on_peer_lost(self, source: str, error) -> None:
        self.qps_at_loss = self.engine.qp_states()
        self.lost.set()

    def on_peer_connected(self, source: str) -> None:
        pass

    def on_peer_gone(self, source: str) -> None:
        pass


def test_qps_of_a_killed_writer_are_gone_before_on_peer_lost():
    """The decode-side invariant: once on_peer_lost fires, the writer's QPs are destroyed on
    this side, so nothing of it can land in blocks the caller now frees."""
    from kvtransfer_helpers import SMOL, engine_config, spawn_writer
    recorder = _Recorder()
    rx = create_engine("verbs", engine_config(), arrivals=recorder)
    recorder.engine = rx
    try:
        pool = torch.zeros((SMOL["num_layers"], 2, 3, 64, 16, 64))
        rx.register_memory(pool)
        ids = list(range(64))
        proc, pipe, _ = spawn_writer("verbs", rx.describe().to_bytes(), 64, (ids, ids, 64, 1, 0),
                                     start_method="forkserver")
        try:
            assert pipe.poll(300) and pipe.recv() == "started"
            time.sleep(0.5)
            assert rx.qp_states()   # the writer's QP is live
            proc.kill()
            assert recorder.lost.wait(60)
        finally:
            proc.kill()
            proc.join(30)
        assert recorder.qps_at_loss == {}
        time.sleep(1.0)
        assert recorder.after_loss == 0 and recorder.immediates > 0
    finally:
        rx.close()


def test_pdserve_doctor_reports_the_stack(capsys):
    """``pdserve doctor --json`` through the CLI's ``main`` in this process (an interpreter start
    costs a minute under the lab's emulated CPU; the console script is that ``main``)."""
    from deploy.cli import main

    capsys.readouterr()
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pyverbs_version"] and report["pyverbs_origin"] and not report["pyverbs_error"]
    devices = list_rdma_devices()
    assert {p["device"] for p in report["ports"]} == set(devices)
    for port in report["ports"]:
        assert port["state"] == "ACTIVE" and port["active_mtu"] in (256, 512, 1024, 2048, 4096)
        chosen = [g for g in port["gids"] if g["chosen"]]
        assert len(chosen) == 1 and chosen[0]["index"] == port["gid_index"]
        if port["link_layer"] == "Ethernet":
            assert "v2" in chosen[0]["gid_type"]
    assert report["auto_engine"] == "verbs" and "GID index" in report["auto_reason"]
    assert report["memlock_soft"] != 0
    from kvtransfer.doctor import diagnose   # the text form
    text = diagnose(EngineConfig(secret=SECRET)).format()
    assert "auto would use: verbs" in text and "<- chosen" in text


def test_bench_runs_verbs_beside_tcp(tmp_path, capsys):
    from bench import kvtransfer as bench
    devices = list_rdma_devices()
    pair = f"{devices[-1]},{devices[0]}"
    out = tmp_path / "kv.json"
    assert bench.main(["--quick", "--rounds", "1", "--methods", "tcp,verbs", "--shapes", "kv-128tok",
                       "--pool-mib", "96", "--verbs-devices", pair, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    got = {(r["shape"], r["method"]): r for r in doc["results"]}
    assert set(got) == {("kv-128tok", m) for m in ("tcp", "verbs")}
    assert all(r["gbps"] > 0 for r in got.values())
    assert "tcp" in got[("kv-128tok", "verbs")]["ratios"]
    table = capsys.readouterr().out
    assert "verbs" in table and "note: verbs" in table
    if any(d.startswith("rxe") for d in devices):
        assert "meaningless" in doc["notes"]["verbs"]
