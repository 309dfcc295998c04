"""Serving modes: path choice, config validation, standalone decode members, /health per mode."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import rpc
from router.api import build_state, create_app
from router.config import RouterConfig
from router.membership import Membership, WorkerState
from router.serving import ServingPath, choose_path, colocate_on_placement, healthy
from rpc import pdserve_pb2 as pb

pytestmark = pytest.mark.unit

COLOCATED, DISAGG = ServingPath.COLOCATED, ServingPath.DISAGGREGATED
EITHER = None   # auto mode: chosen at placement (`colocate_on_placement`)


def info(wid: str, role) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=wid, role=role, grpc_address="127.0.0.1:1", host_id="h",
                         protocol_version=rpc.PROTOCOL_VERSION, compat_hash="abc", num_blocks=64,
                         block_size=16, transfer_engine="tcp")


@pytest.mark.parametrize("mode,threshold,tokens,pair,path", [
    ("disaggregated", 0, 10, True, DISAGG),
    ("disaggregated", 0, 10, False, DISAGG),      # no fallback: NoWorkers later
    ("colocated", 0, 5000, True, COLOCATED),
    ("auto", 0, 10, True, EITHER),                # threshold 0: never colocated by length...
    ("auto", 0, 10, False, COLOCATED),            # ...and colocated when no pair is there at all
    ("auto", 128, 127, True, COLOCATED),
    ("auto", 128, 128, True, EITHER),
])
def test_choose_path(mode, threshold, tokens, pair, path):
    assert choose_path(mode, threshold, tokens, pair) is path


@pytest.mark.parametrize("prefill,colocated,tokens,bound,speed,want", [
    ([0], [0], 300, 1024, 0.5, False),            # the prefill worker has room
    ([1023], [0], 300, 1024, 0.5, False),         # just below its backlog bound
    ([1024], [0], 300, 1024, 0.5, True),          # at it: (0 + 300) / 0.5 <= 1024 + 300
    ([1024], [362], 300, 1024, 0.5, True),        # (362 + 300) / 0.5 = 1324: equal waits
    ([1024], [363], 300, 1024, 0.5, False),       # the decode worker's queue is the longer wait
    ([1024], [700], 300, 1024, 1.0, True),        # ... unless it prefills as fast
    ([4096, 500], [0], 300, 1024, 0.5, False),    # one prefill worker below the bound: it
    ([4096, 2000], [0, 5000], 300, 1024, 0.5, True),   # the least-queued decode worker counts
    ([10**6], [0], 300, 0, 0.5, False),           # bound 0: the rule is off
    ([], [0], 300, 1024, 0.5, False),             # no prefill worker, no decode worker: the
    ([4096], [], 300, 1024, 0.5, False),          # caller's other checks decide
])
def test_colocate_on_placement_joins_the_shortest_expected_delay(prefill, colocated, tokens, bound, speed, want):
    assert colocate_on_placement(prefill, colocated, tokens, bound, speed) is want


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
    assert orch._path(prompt)[0] is EITHER                  # nothing held: 300 to compute
    m.kv_index.apply("d0", pb.KVEvents(snapshot=True, stored=block_hashes(prompt[:256], 16)))
    assert orch._path(prompt)[0] is COLOCATED               # 16 blocks held: 44 left
    assert orch._path(prompt[:50] + prompt)[0] is EITHER    # another prefix: nothing held


def test_auto_mode_prefills_on_the_decode_worker_while_every_prefill_worker_is_backed_up():
    """The path of a prompt placed now, from this router's in-flight counts: a prefill worker
    while one is below the backlog bound; the decode worker while its colocated queue is the
    shorter expected wait; colocated when no linked pair is left."""
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
    assert orch._path(prompt)[0] is EITHER                  # chosen at placement
    assert orch._placement_path(300) is DISAGG              # nothing in flight
    orch.inflight.start_prefill("p0", 1500)
    assert orch._placement_path(300) is DISAGG              # p1 is free
    orch.inflight.start_prefill("p1", 999)
    assert orch._placement_path(300) is DISAGG              # p1 below the bound
    orch.inflight.start_prefill("p1", 1)
    assert orch._placement_path(300) is COLOCATED           # both at the bound, d0's queue empty
    orch.inflight.start_colocated("d0", 350)
    assert orch._placement_path(300) is COLOCATED           # (350 + 300) / 0.5 <= 1000 + 300
    orch.inflight.start_colocated("d0", 1)
    assert orch._placement_path(300) is DISAGG              # d0's queue is now the longer wait
    orch.inflight.end_colocated("d0", 351)
    assert orch._placement_path(300) is COLOCATED           # its prompts started
    orch.inflight.end_prefill("p0", 1500)
    assert orch._placement_path(300) is DISAGG              # p0 drained
    off = Orchestrator(RouterConfig(serving_mode="auto", auto_prefill_backlog_tokens=0), m, None,
                       make_policy("load"), RouterMetrics(m))
    off.inflight.start_prefill("p0", 10**6)
    off.inflight.start_prefill("p1", 10**6)
    assert off._placement_path(300) is DISAGG               # 0: never by load
    for p in ps:
        m.leave(p.worker_id)
    assert off._placement_path(300) is COLOCATED            # no linked pair left


def test_auto_mode_places_on_the_side_chosen_when_placed_and_counts_the_colocated_queue():
    """A prompt that arrived while the prefill worker had room is placed colocated once that
    worker is full (no wait behind it); its tokens count in the decode worker's colocated queue
    until its first token."""
    import asyncio
    import time

    from router.metrics import RouterMetrics
    from router.orchestrator import Orchestrator
    from router.policy import make_policy
    from router.request import Attempt

    m = Membership(standalone_decode=True)
    p, _ = m.register(info("p0", pb.PREFILL))
    d, _ = m.register(info("d0", pb.DECODE))
    assert m.link("p0", "d0", (p.epoch, d.epoch))
    orch = Orchestrator(RouterConfig(serving_mode="auto"), m, None, make_policy("load"), RouterMetrics(m))
    prompt = list(range(1000, 1300))
    path, _ = orch._path(tuple(prompt))
    assert path is EITHER
    orch.inflight.start_prefill("p0", orch.config.prefill_inflight_tokens)   # full since it arrived
    attempt = Attempt("r1")
    assert asyncio.run(orch._place_on(path, attempt, prompt, 16, set(), time.monotonic())) is True
    assert attempt.colocated and attempt.decode.worker_id == "d0"
    assert orch.inflight.colocated_tokens["d0"] == 300 and attempt.colocated_tokens == 300
    orch._colocated_started(attempt)
    orch._colocated_started(attempt)   # once only
    assert "d0" not in orch.inflight.colocated_tokens and attempt.colocated_tokens == 0
