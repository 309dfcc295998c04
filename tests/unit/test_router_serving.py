"""Serving modes: path choice, config validation, standalone decode members, /health per mode."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import rpc
from router.api import build_state, create_app
from router.config import RouterConfig
from router.membership import Membership, WorkerState
from router.serving import ServingPath, choose_path, healthy
from rpc import pdserve_pb2 as pb

pytestmark = pytest.mark.unit

COLOCATED, DISAGG = ServingPath.COLOCATED, ServingPath.DISAGGREGATED


def info(wid: str, role) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=wid, role=role, grpc_address="127.0.0.1:1", host_id="h",
                         protocol_version=rpc.PROTOCOL_VERSION, compat_hash="abc", num_blocks=64,
                         block_size=16, transfer_engine="tcp")


@pytest.mark.parametrize("mode,threshold,tokens,pair,path", [
    ("disaggregated", 0, 10, True, DISAGG),
    ("disaggregated", 0, 10, False, DISAGG),      # no fallback: NoWorkers later
    ("colocated", 0, 5000, True, COLOCATED),
    ("auto", 0, 10, True, DISAGG),                # threshold 0: never colocated...
    ("auto", 0, 10, False, COLOCATED),            # ...unless no pair is there at all
    ("auto", 128, 127, True, COLOCATED),
    ("auto", 128, 128, True, DISAGG),
])
def test_choose_path(mode, threshold, tokens, pair, path):
    assert choose_path(mode, threshold, tokens, pair) is path


@pytest.mark.parametrize("mode,path", [("auto", COLOCATED), ("disaggregated", DISAGG), ("colocated", COLOCATED)])
def test_a_backed_up_prefill_side_sends_long_prompts_colocated_in_auto_mode_only(mode, path):
    assert choose_path(mode, 128, 5000, True, prefill_backlogged=True) is path


def test_config_validates_mode_and_threshold():
    assert RouterConfig(serving_mode="auto", colocated_threshold_tokens=256).colocated_threshold_tokens == 256
    RouterConfig(serving_mode="colocated")
    with pytest.raises(ValueError, match="serving_mode"):
        RouterConfig(serving_mode="mixed")
    with pytest.raises(ValueError, match=">= 0"):
        RouterConfig(serving_mode="auto", colocated_threshold_tokens=-1)
    with pytest.raises(ValueError, match="auto"):
        RouterConfig(colocated_threshold_tokens=64)  # disaggregated mode ignores it: refuse
    with pytest.raises(ValueError, match="auto_prefill_backlog_tokens"):
        RouterConfig(serving_mode="auto", auto_prefill_backlog_tokens=-1)


def test_flags_mirror_the_fields():
    import argparse

    ap = argparse.ArgumentParser()
    RouterConfig.add_arguments(ap)
    c = RouterConfig.from_args(ap.parse_args(["--serving-mode", "auto",
                                              "--colocated-threshold-tokens", "100"]))
    assert (c.serving_mode, c.colocated_threshold_tokens) == ("auto", 100)


def test_healthy():
    assert not healthy("disaggregated", 0, 1) and healthy("disaggregated", 1, 1)
    assert healthy("colocated", 0, 1) and healthy("auto", 0, 1)
    assert not healthy("colocated", 1, 0)


def test_standalone_decode_members_are_routable_at_once():
    m = Membership(standalone_decode=True)
    p, _ = m.register(info("p0", pb.PREFILL))
    d, _ = m.register(info("d0", pb.DECODE))
    assert d.state == WorkerState.CONNECTED and p.state == WorkerState.JOINING
    assert [x.worker_id for x in m.routable("decode")] == ["d0"]
    assert m.link("p0", "d0", (p.epoch, d.epoch))  # linking still works and keeps it CONNECTED
    assert m.get("d0").state == WorkerState.CONNECTED and m.get("p0").state == WorkerState.CONNECTED
    assert Membership().register(info("d1", pb.DECODE))[0].state == WorkerState.JOINING


@pytest.mark.parametrize("mode,status", [("disaggregated", 503), ("colocated", 200), ("auto", 200)])
def test_health_with_a_decode_worker_only(mode, status):
    from engine.tokenizer import Tokenizer
    from engine.modelfile import resolve_model_path

    membership = Membership(standalone_decode=mode != "disaggregated")
    membership.register(info("d0", pb.DECODE))
    state = build_state(RouterConfig(serving_mode=mode), Tokenizer.from_file(resolve_model_path(None)),
                        64, membership, "/m.gguf")
    with TestClient(create_app(state)) as client:
        r = client.get("/health")
        assert r.status_code == status and r.json()["decode"] == (0 if status == 503 else 1)
        assert "pdserve_requests_by_path" in client.get("/metrics").text


def test_auto_mode_counts_only_tokens_past_the_prefix_a_decode_worker_holds():
    """Conditional disaggregation: a later turn whose history its decode worker holds is
    prefilled there; the same prompt with nothing cached goes to a prefill worker."""
    from engine.block_hash import block_hashes
    from router.metrics import RouterMetrics
    from router.orchestrator import Orchestrator
    from router.policy import make_policy

    m = Membership(standalone_decode=True)
    p, _ = m.register(info("p0", pb.PREFILL))
    d_info = info("d0", pb.DECODE)
    d_info.prefix_caching = True
    d, _ = m.register(d_info)
    assert m.link("p0", "d0", (p.epoch, d.epoch))
    config = RouterConfig(serving_mode="auto", colocated_threshold_tokens=100, policy="kv")
    orch = Orchestrator(config, m, None, make_policy("kv", m.kv_index), RouterMetrics(m))
    prompt = tuple(range(1000, 1300))                       # 300 tokens: 18 full blocks
    assert orch._path(prompt)[0] is DISAGG                  # nothing held: 300 to compute
    m.kv_index.apply("d0", pb.KVEvents(snapshot=True, stored=block_hashes(prompt[:256], 16)))
    assert orch._path(prompt)[0] is COLOCATED               # 16 blocks held: 44 left
    assert orch._path(prompt[:50] + prompt)[0] is DISAGG    # another prefix: nothing held


def test_auto_mode_prefills_on_the_decode_worker_while_every_prefill_worker_is_backed_up():
    from router.metrics import RouterMetrics
    from router.orchestrator import Orchestrator
    from router.policy import make_policy

    m = Membership(standalone_decode=True)
    ps = [m.register(info(f"p{i}", pb.PREFILL))[0] for i in range(2)]
    d, _ = m.register(info("d0", pb.DECODE))
    for p in ps:
        assert m.link(p.worker_id, "d0", (p.epoch, d.epoch))
    config = RouterConfig(serving_mode="auto", colocated_threshold_tokens=100, auto_prefill_backlog_tokens=1000)
    orch = Orchestrator(config, m, None, make_policy("load"), RouterMetrics(m))
    prompt = tuple(range(1000, 1300))
    assert orch._path(prompt)[0] is DISAGG                  # nothing in flight
    orch.inflight.start_prefill("p0", 1500)
    assert orch._path(prompt)[0] is DISAGG                  # p1 is free
    orch.inflight.start_prefill("p1", 999)
    assert orch._path(prompt)[0] is DISAGG                  # p1 below the bound
    orch.inflight.start_prefill("p1", 1)
    assert orch._path(prompt)[0] is COLOCATED               # both at the bound
    orch.inflight.end_prefill("p0", 1500)
    assert orch._path(prompt)[0] is DISAGG                  # p0 drained
    off = Orchestrator(RouterConfig(serving_mode="auto", auto_prefill_backlog_tokens=0), m, None,
                       make_policy("load"), RouterMetrics(m))
    off.inflight.start_prefill("p0", 10**6)
    off.inflight.start_prefill("p1", 10**6)
    assert off._path(prompt)[0] is DISAGG                   # 0: never by load
