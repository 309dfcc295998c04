"""Routing policy: load-aware ordering, the router's own in-flight accounting, round robin."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.membership import Load, Member, WorkerState
from router.policy import Inflight, LoadPolicy, RoundRobinPolicy, make_policy, sequence_blocks

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


def test_blocks_of_finished_requests_count_as_free_until_heartbeats_reflect_them():
    from router.kvindex import KVIndex
    idx = KVIndex()
    h = [bytes([i]) * 16 for i in range(20)]
    idx.apply("d0", _events(snapshot=True, stored=h[:12]))   # holds the conversation's 12 blocks
    idx.apply("d1", _events(snapshot=True, stored=[]))
    # the last heartbeat of d0 still counts the finished turn (and two others) in use: 70 blocks
    d0, d1 = (member("d0", "decode", free_blocks=30, total_blocks=100),
              member("d1", "decode", free_blocks=95, total_blocks=100))
    pol = make_policy("kv", idx)
    inflight = Inflight()
    assert ids(pol.order_decode([d0, d1], inflight, 20, h)) == ["d1", "d0"]   # 4 x 8 + 70 > 4 x 20 + 5
    inflight.add_release(d0, 40)                       # the router saw 40 of them finish since
    assert inflight.released_blocks(d0) == 40 and inflight.free_blocks(d0) == 70
    assert ids(pol.order_decode([d0, d1], inflight, 20, h)) == ["d0", "d1"]   # 4 x 8 + 30 < 85
    inflight.add_release(d0, 80)
    assert inflight.free_blocks(d0) == 100                 # never more than the pool
    d0_later = replace(d0, heartbeats=d0.heartbeats + 2, load=Load(free_blocks=70, total_blocks=100))
    assert inflight.released_blocks(d0_later) == 0 and inflight.free_blocks(d0_later) == 70


def test_a_finished_request_released_its_prompt_blocks_once_and_each_choices_own():
    assert sequence_blocks(40, [30], 16) == 5          # 70 tokens
    assert sequence_blocks(32, [0], 16) == 2
    # two choices share the 2 full prompt blocks; each has its own third block onwards
    assert sequence_blocks(40, [30, 8], 16) == 2 + 3 + 1


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


def _events(snapshot=False, stored=(), removed=()):
    from rpc import pdserve_pb2 as pb
    return pb.KVEvents(snapshot=snapshot, stored=list(stored), removed=list(removed))


def test_kv_index_needs_a_snapshot_first_then_applies_events():
    from router.kvindex import KVIndex
    idx = KVIndex()
    h = [bytes([i]) * 16 for i in range(5)]
    assert idx.apply("d0", _events(stored=h[:2]))          # no snapshot yet: asks for one
    assert idx.overlap("d0", h) == 0
    assert not idx.apply("d0", _events(snapshot=True, stored=h[:3]))
    assert idx.overlap("d0", h) == 3 and idx.overlap("d0", [h[4]] + h[:3]) == 0   # leading blocks only
    assert not idx.apply("d0", _events(stored=[h[3]], removed=[h[1]]))
    assert idx.overlap("d0", h) == 1 and idx.sizes() == {"d0": 3} and idx.evictions == {"d0": 1}
    idx.drop("d0")
    assert idx.overlap("d0", h) == 0 and idx.apply("d0", _events(stored=h))


def test_kv_policy_weighs_cached_blocks_against_load():
    from router.kvindex import KVIndex
    from router.policy import KVPolicy
    idx = KVIndex()
    h = [bytes([i]) * 16 for i in range(10)]
    idx.apply("d1", _events(snapshot=True, stored=h[:8]))
    idx.apply("p1", _events(snapshot=True, stored=h[:6]))
    pol = make_policy("kv", idx)
    assert isinstance(pol, KVPolicy) and pol.uses_hashes
    # d1 holds 8 of the 10 blocks: 2 to receive + 15 in use beats 10 + 10
    ds = [member("d0", "decode", free_blocks=90, total_blocks=100), member("d1", "decode", free_blocks=85, total_blocks=100)]
    assert ids(pol.order_decode(ds, Inflight(), 10, h)) == ["d1", "d0"]
    # ... unless it is much busier
    busy = [ds[0], member("d1", "decode", free_blocks=40, total_blocks=100)]
    assert ids(pol.order_decode(busy, Inflight(), 10, h)) == ["d0", "d1"]
    # ... or cannot hold what it lacks
    full = [ds[0], member("d1", "decode", free_blocks=1, total_blocks=100)]
    assert ids(pol.order_decode(full, Inflight(), 10, h)) == ["d0", "d1"]
    # prefill: 4 blocks to compute + 32 queued tokens (2 blocks) beats 10 blocks
    ps = [member("p0", "prefill"), member("p1", "prefill", queued_prompt_tokens=32)]
    assert ids(pol.order_prefill(ps, Inflight(), 10, h)) == ["p1", "p0"]
    # no index (no hashes): load only
    assert ids(pol.order_prefill(ps, Inflight(), 10, ())) == ["p0", "p1"]
    with pytest.raises(ValueError):
        make_policy("kv")


def test_kv_index_predictions_count_until_they_expire_or_are_evicted():
    from router.kvindex import KVIndex
    now = [100.0]
    idx = KVIndex(clock=lambda: now[0])
    h = [bytes([i]) * 16 for i in range(4)]
    idx.predict("d0", h)                                   # not indexed yet: ignored
    assert idx.overlap("d0", h) == 0
    idx.apply("d0", _events(snapshot=True, stored=h[:1]))
    idx.predict("d0", h[:3], ttl_s=5.0)
    assert idx.overlap("d0", h) == 3
    idx.apply("d0", _events(removed=[h[1]]))               # evicted: the prediction goes too
    assert idx.overlap("d0", h) == 1
    idx.predict("d0", h[1:3], ttl_s=5.0)
    now[0] += 5.0                                          # expired
    assert idx.overlap("d0", h) == 1


def test_kv_policy_weighs_blocks_a_decode_worker_lacks_four_times_by_default():
    from router.kvindex import KVIndex
    idx = KVIndex()
    h = [bytes([i]) * 16 for i in range(30)]
    idx.apply("d1", _events(snapshot=True, stored=h[:24]))   # holds 24 of the 30 blocks
    idx.apply("d0", _events(snapshot=True, stored=[]))
    # d1 runs two more conversations (70 blocks in use): 4 x 6 + 80 < 4 x 30 + 10
    ds = [member("d0", "decode", free_blocks=90, total_blocks=100), member("d1", "decode", free_blocks=20, total_blocks=100)]
    assert ids(make_policy("kv", idx).order_decode(ds, Inflight(), 30, h)) == ["d1", "d0"]
    # with Dynamo's weight of 1 the load wins: 6 + 80 > 30 + 10
    assert ids(make_policy("kv", idx, decode_overlap_weight=1.0).order_decode(ds, Inflight(), 30, h)) == ["d0", "d1"]
