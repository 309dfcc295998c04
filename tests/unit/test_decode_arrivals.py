"""When a writer can no longer land anything: an engine's `PeerConnections` (a writer is gone once
its last connection has ended) and the decode worker's `DecodeArrivals` (gone from every engine of
the worker, its own and its TP ranks'), which frees quarantined blocks only then."""

from __future__ import annotations

import pytest

from decode.arrivals import DecodeArrivals
from kvtransfer import ImmediateQueue, PeerLostError, SlotState
from kvtransfer.connection import PeerConnections

pytestmark = pytest.mark.unit


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_writer_is_connected_at_its_first_connection_and_gone_after_its_last():
    arrivals = ImmediateQueue()
    peers = PeerConnections(arrivals)
    stream_a, stream_b = object(), object()
    peers.opened(stream_a, "w")
    peers.opened(stream_b, "w")
    peers.opened(stream_b, "w")   # told twice: still one connection
    assert _drain(arrivals.connected) == ["w"]
    peers.ended(stream_a)
    peers.ended(stream_a)   # idempotent
    peers.ended(object())   # never opened: ignored
    assert _drain(arrivals.gone) == []   # its other stream may still be landing a write
    peers.ended(stream_b)
    assert _drain(arrivals.gone) == ["w"]
    peers.opened(stream_a, "w")   # connects again
    assert _drain(arrivals.connected) == ["w"]


def test_the_decode_worker_counts_a_writer_lost_only_when_no_engine_of_it_holds_a_connection():
    arrivals = DecodeArrivals(4)
    told: list[str] = []
    arrivals.on_lost.append(told.append)
    slot, gen = arrivals.counter.acquire(60.0)
    arrivals.counter.expect(slot, gen, 10, "w")
    arrivals.on_peer_connected("w")   # rank 0's engine
    arrivals.on_peer_connected("w")   # a follower rank's engine
    arrivals.on_peer_lost("w", PeerLostError("one stream reset"))
    assert arrivals.counter.state(slot).state == SlotState.FAILED   # its transfer fails at once
    assert "w" not in arrivals.lost and told == []                  # but it may still write
    arrivals.on_peer_gone("w")
    assert "w" not in arrivals.lost and told == []                  # connected to the other engine
    arrivals.on_peer_gone("w")
    assert "w" in arrivals.lost and told == ["w"]
    arrivals.on_peer_connected("w")
    assert "w" not in arrivals.lost
