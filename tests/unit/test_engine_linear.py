"""engine/linear.py: the one-row gemv copies are kept only where timing at load finds them
faster, and then consistently for every projection."""

from __future__ import annotations

import time

import torch

from engine.linear import Linear, gemv_copy_pays, onednn_available


class _TimedPaths:
    """A stand-in `Linear` whose two one-row paths cost a known time (a fake: the real kernels'
    speeds cannot be set; only the decision is under test)."""

    in_features = 4

    def __init__(self, gemv_s: float, packed_s: float):
        self.gemv_s, self.packed_s = gemv_s, packed_s

    def gemv(self, x):
        time.sleep(self.gemv_s)

    def packed(self, x):
        time.sleep(self.packed_s)


def test_gemv_copies_pay_only_when_faster():
    assert gemv_copy_pays([_TimedPaths(1e-3, 3e-3)], reps=3)
    assert not gemv_copy_pays([_TimedPaths(3e-3, 1e-3)], reps=3)


def test_both_one_row_paths_compute_the_same_product():
    if not onednn_available():
        import pytest

        pytest.skip("this torch build has no oneDNN packed linear")
    w, x = torch.randn(64, 32), torch.randn(1, 32)
    lin = Linear(w, "onednn", gemv_copy=True)
    assert lin.has_gemv_copy
    torch.testing.assert_close(lin.gemv(x), lin.packed(x), rtol=1e-4, atol=1e-4)
    lin.drop_gemv_copy()
    assert not lin.has_gemv_copy
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-4, atol=1e-4)


def test_the_models_choice_holds_for_every_projection():
    from engine.loader import load_model

    m = load_model(weights="fp32")
    linears = [p for lin in m.model._layers for p in vars(lin).values()] + [m.model._lm_head]
    assert {p.has_gemv_copy for p in linears} == {m.model.gemv_copies}
    m = load_model(weights="fp32", gemv_copies=False)   # a prefill worker: never a copy
    assert not m.model.gemv_copies
