"""Arrival schedules: seeded statistics match vLLM's gamma/Poisson/fixed definitions."""

import math

import numpy as np
import pytest

from loadtest.arrivals import arrival_gaps, arrival_times
from loadtest.errors import ConfigError

pytestmark = pytest.mark.unit
N = 20000


def _cv2(gaps):
    return float(np.var(gaps) / np.mean(gaps) ** 2)


def test_poisson_gaps_are_exponential():
    gaps = arrival_gaps(N, rate=5.0, kind="poisson", seed=1)
    assert np.mean(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    assert _cv2(gaps) == pytest.approx(1.0, rel=0.06)
    # Exponential: P(gap > mean) = e^-1.
    assert np.mean(gaps > 0.2) == pytest.approx(math.exp(-1), abs=0.015)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_shape(burstiness):
    gaps = arrival_gaps(N, rate=2.0, kind="gamma", burstiness=burstiness, seed=2)
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert _cv2(gaps) == pytest.approx(1 / burstiness, rel=0.1)  # shape k: CV^2 = 1/k


def test_poisson_ignores_burstiness_and_fixed_is_constant():
    assert np.array_equal(arrival_gaps(10, 3.0, "poisson", 7.0, seed=3),
                          arrival_gaps(10, 3.0, "poisson", 1.0, seed=3))
    assert np.allclose(arrival_gaps(10, 4.0, "fixed"), 0.25)
    assert np.allclose(arrival_times(4, 4.0, "fixed"), [0.25, 0.5, 0.75, 1.0])


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_times(5, math.inf), np.zeros(5))


def test_seeded_and_normalized_like_vllm():
    a = arrival_times(100, 10.0, "gamma", 0.5, seed=4)
    assert np.array_equal(a, arrival_times(100, 10.0, "gamma", 0.5, seed=4))
    assert not np.array_equal(a, arrival_times(100, 10.0, "gamma", 0.5, seed=5))
    assert a[-1] == pytest.approx(100 / 10.0)  # rescaled so the last send is at n / rate
    assert np.all(np.diff(a) >= 0)
    raw = arrival_times(100, 10.0, "gamma", 0.5, seed=4, normalize=False)
    assert raw[-1] != pytest.approx(10.0, rel=1e-6)


@pytest.mark.parametrize("kw", [dict(rate=0.0), dict(rate=1.0, burstiness=0.0),
                                dict(rate=1.0, kind="uniform")])
def test_rejects_bad_arguments(kw):
    with pytest.raises(ConfigError):
        arrival_gaps(3, **kw)
