"""Membership table and the Registry servicer (called directly, no sockets)."""

from __future__ import annotations

import pytest

import rpc
from router.config import RouterConfig
from router.membership import Load, Membership, Refused, WorkerState, transition
from router.registry import RegistryServicer
from rpc import pdserve_pb2 as pb

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def info(wid: str, role=pb.PREFILL, compat="abc", version=rpc.PROTOCOL_VERSION) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=wid, role=role, grpc_address="127.0.0.1:1", host_id="h",
                         protocol_version=version, compat_hash=compat, num_blocks=64, block_size=16,
                         transfer_engine="tcp")


def test_transition_function():
    assert transition(WorkerState.JOINING, WorkerState.CONNECTED) == WorkerState.CONNECTED
    assert transition(WorkerState.CONNECTED, WorkerState.CONNECTED) == WorkerState.CONNECTED
    for bad in [(WorkerState.GONE, WorkerState.JOINING), (WorkerState.DRAINING, WorkerState.CONNECTED),
                (WorkerState.CONNECTED, WorkerState.JOINING)]:
        with pytest.raises(ValueError):
            transition(*bad)


def test_refuses_wrong_protocol_and_compat_hash_mismatch():
    m = Membership()
    with pytest.raises(Refused, match="protocol version"):
        m.register(info("p0", version=rpc.PROTOCOL_VERSION + 1))
    m.register(info("p0", compat="first"))          # pins the hash
    with pytest.raises(Refused, match="compatibility hash"):
        m.register(info("d0", pb.DECODE, compat="other"))
    with pytest.raises(Refused, match="role"):
        m.register(info("x", role=pb.ROLE_UNSPECIFIED, compat="first"))


def test_link_makes_both_routable_and_leave_unlinks():
    m = Membership()
    p, _ = m.register(info("p0"))
    d, _ = m.register(info("d0", pb.DECODE))
    assert m.routable("prefill") == [] and [(a.worker_id, b.worker_id) for a, b in m.unlinked_pairs()] == [("p0", "d0")]
    assert m.link("p0", "d0", (p.epoch, d.epoch))
    assert [x.worker_id for x in m.routable("decode")] == ["d0"]
    assert m.get("p0").peers == {"d0"} and m.unlinked_pairs() == []
    gone = m.leave("d0")
    assert gone.state == WorkerState.GONE and gone.peers == {"p0"}
    assert m.get("p0").peers == frozenset() and m.get("d0") is None
    assert m.leave("d0") is None


def test_link_refused_for_stale_epoch():
    m = Membership()
    p, _ = m.register(info("p0"))
    d, _ = m.register(info("d0", pb.DECODE))
    m.register(info("d0", pb.DECODE))  # re-registered: a new epoch
    assert not m.link("p0", "d0", (p.epoch, d.epoch))


def test_heartbeats_draining_and_expiry():
    clock = Clock()
    m = Membership(clock)
    m.register(info("p0"))
    m.register(info("d0", pb.DECODE))
    assert not m.heartbeat("nobody", Load())
    clock.now += 3
    assert m.heartbeat("d0", Load(free_blocks=5, total_blocks=64))
    assert m.get("d0").load.free_blocks == 5 and m.get("d0").heartbeats == 1
    assert m.heartbeat("p0", Load(draining=True))
    assert m.get("p0").state == WorkerState.DRAINING
    clock.now += 3
    m.heartbeat("d0", Load())
    clock.now += 3                      # p0 silent for 6 s, d0 for 3 s
    dead = m.expire(5.0)
    assert [x.worker_id for x in dead] == ["p0"]
    assert m.get("d0") is not None


def test_listener_called_on_change():
    m = Membership()
    calls = []
    m.add_listener(lambda: calls.append(1))
    m.register(info("p0"))
    m.heartbeat("p0", Load())
    m.leave("p0")
    assert len(calls) == 3


def test_registry_servicer_accepts_refuses_and_forgets():
    m = Membership()
    joined, gone = [], []
    svc = RegistryServicer(m, RouterConfig(heartbeat_interval_s=0.5, dead_after_s=2), "router-x",
                           joined.append, gone.append)
    r = svc.Register(pb.RegisterRequest(worker=info("p0")), None)
    assert r.accepted and r.heartbeat_interval_ms == 500 and r.router_id == "router-x"
    r = svc.Register(pb.RegisterRequest(worker=info("d0", pb.DECODE, compat="zzz")), None)
    assert not r.accepted and "compatibility hash" in r.reason
    assert svc.Heartbeat(pb.HeartbeatRequest(worker_id="p0"), None).known
    svc.Register(pb.RegisterRequest(worker=info("p0")), None)        # restart: old one is gone
    assert [x.worker_id for x in gone] == ["p0"] and len(joined) == 2
    svc.Leave(pb.LeaveRequest(worker_id="p0"), None)
    assert not svc.Heartbeat(pb.HeartbeatRequest(worker_id="p0"), None).known


def test_config_validation():
    with pytest.raises(ValueError):
        RouterConfig(policy="fastest")
    with pytest.raises(ValueError):
        RouterConfig(heartbeat_interval_s=2, dead_after_s=1)
    with pytest.raises(ValueError):
        RouterConfig(registry_address="nohost")


def test_a_worker_reporting_a_dead_loop_is_not_routable_until_healthy_again():
    m = Membership()
    m.register(info("p"))
    m.register(info("d", role=pb.DECODE))
    assert m.link("p", "d", (1, 2))
    assert [x.worker_id for x in m.routable("decode")] == ["d"]
    m.heartbeat("d", Load.from_pb(pb.LoadStats(unhealthy=True, unhealthy_reason="decode-loop thread died")))
    assert m.routable("decode") == [] and m.get("d").state == WorkerState.CONNECTED
    m.heartbeat("d", Load.from_pb(pb.LoadStats()))
    assert [x.worker_id for x in m.routable("decode")] == ["d"]
