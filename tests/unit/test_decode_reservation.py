"""The decode reservation's state machine and its optional transfer (`decode.reservation`)."""

from __future__ import annotations

import pytest

from decode.reservation import Reservation, ResState, TransferSlot
from kvtransfer import Generation, SlotId

pytestmark = pytest.mark.unit


def _reserved() -> Reservation:
    return Reservation("r", [], TransferSlot(SlotId(3), Generation(7)), 16, deadline=10.0)


def test_a_reserved_request_has_a_transfer_and_walks_the_table():
    r = _reserved()
    assert r.state == ResState.RESERVED and r.require_transfer() == TransferSlot(3, 7)
    r.move(ResState.WAITING_KV)
    r.move(ResState.DECODING)
    r.move(ResState.DONE)
    with pytest.raises(AssertionError):
        r.move(ResState.FAILED)   # DONE is absorbing


def test_a_colocated_request_has_no_transfer_and_starts_decoding():
    r = Reservation("c", [], None, 16, float("inf"), state=ResState.DECODING)
    assert r.transfer is None
    with pytest.raises(AssertionError, match="no KV transfer"):
        r.require_transfer()
    with pytest.raises(AssertionError):
        r.move(ResState.FAILED)   # only a request waiting for its KV fails


def test_a_transfer_exactly_when_waiting_for_kv():
    with pytest.raises(AssertionError):
        Reservation("x", [], None, 16, 10.0)   # RESERVED without a slot
    with pytest.raises(AssertionError):
        Reservation("y", [], TransferSlot(SlotId(0), Generation(0)), 16, 10.0, state=ResState.DECODING)
