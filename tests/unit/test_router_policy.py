"""Routing policy: load-aware ordering, the router's own in-flight accounting, round robin."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.membership import Load, Member, WorkerState
from router.policy import Inflight, LoadPolicy, RoundRobinPolicy, make_policy

pytestmark = pytest.mark.unit


def member(wid: str, role: str, heartbeats: int = 1, **load) -> Member:
    return Member(wid, role, f"127.0.0.1:{len(wid)}", "host", "m", 100, 16, "tcp", epoch=1,
                  state=WorkerState.CONNECTED, load=Load(**load), heartbeats=heartbeats)


def ids(members):
    return [m.worker_id for m in members]


def test_decode_prefers_most_free_blocks_then_smallest_batch():
    ds = [member("d0", "decode", free_blocks=10, running=1),
          member("d1", "decode", free_blocks=50, running=9),
          member("d2", "decode", free_blocks=50, running=2)]
    assert ids(LoadPolicy().order_decode(ds, Inflight(), needed_blocks=1)) == ["d2", "d1", "d0"]


def test_workers_that_cannot_hold_the_prompt_go_last():
    ds = [member("d0", "decode", free_blocks=3), member("d1", "decode", free_blocks=2)]
    assert ids(LoadPolicy().order_decode(ds, Inflight(), needed_blocks=3)) == ["d0", "d1"]
    assert ids(LoadPolicy().order_decode(ds, Inflight(), needed_blocks=4)) == ["d0", "d1"]


def test_router_reservations_count_until_heartbeats_reflect_them():
    d0, d1 = member("d0", "decode", free_blocks=40), member("d1", "decode", free_blocks=30)
    inflight = Inflight()
    inflight.add_reservation(d0, 20)          # d0 effectively has 20 free now
    assert inflight.pending_blocks(d0) == 20
    assert ids(LoadPolicy().order_decode([d0, d1], inflight, 1)) == ["d1", "d0"]
    d0_later = replace(d0, heartbeats=d0.heartbeats + 2, load=Load(free_blocks=20))
    assert inflight.pending_blocks(d0_later) == 0
    assert ids(LoadPolicy().order_decode([d0_later, d1], inflight, 1)) == ["d1", "d0"]


def test_prefill_by_queued_tokens_including_in_flight():
    ps = [member("p0", "prefill", queued_prompt_tokens=100), member("p1", "prefill", queued_prompt_tokens=50)]
    inflight = Inflight()
    assert ids(LoadPolicy().order_prefill(ps, inflight)) == ["p1", "p0"]
    inflight.start_prefill("p1", 80)
    assert ids(LoadPolicy().order_prefill(ps, inflight)) == ["p0", "p1"]
    inflight.end_prefill("p1", 80)
    assert inflight.prefill_tokens == {}
    assert ids(LoadPolicy().order_prefill(ps, inflight)) == ["p1", "p0"]


def test_round_robin_rotates_regardless_of_load():
    ds = [member("d1", "decode", free_blocks=1), member("d0", "decode", free_blocks=99)]
    rr = RoundRobinPolicy()
    firsts = [rr.order_decode(ds, Inflight(), 1)[0].worker_id for _ in range(4)]
    assert firsts == ["d0", "d1", "d0", "d1"]
    assert rr.order_prefill([], Inflight()) == []


def test_make_policy():
    assert make_policy("load").name == "load"
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError):
        make_policy("random")
