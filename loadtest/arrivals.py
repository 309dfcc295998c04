"""Request arrival schedules: when each request is sent, as seconds after the run starts.

Semantics follow vLLM's ``vllm bench serve`` (``get_request`` in vllm/benchmarks/serve.py):

- ``rate = inf``: every request at t = 0.
- ``fixed``: constant gaps of ``1 / rate`` s (vLLM's ``burstiness = inf``).
- ``poisson``: exponential gaps of mean ``1 / rate`` s (gamma with shape 1).
- ``gamma``: gaps ~ Gamma(shape = burstiness, scale = 1 / (rate * burstiness)); mean ``1 / rate``,
  squared coefficient of variation ``1 / burstiness`` (< 1: burstier than Poisson, > 1: smoother).

The first request waits its own gap (as in vLLM). With ``normalize`` (vLLM's default behaviour for
a constant rate) the cumulative times are rescaled so the last one is exactly ``n / rate``, which
removes the 1-2% seed-to-seed spread of the total send time.
"""

from __future__ import annotations

import math

import numpy as np

from loadtest.errors import ConfigError


def arrival_gaps(n: int, rate: float, kind: str = "poisson", burstiness: float = 1.0,
                 seed: int = 0) -> np.ndarray:
    """``n`` gaps between consecutive sends, seconds (float64, shape ``[n]``), seeded."""
    if n < 0 or not rate > 0 or not burstiness > 0:
        raise ConfigError(f"need n >= 0, rate > 0, burstiness > 0: {n}, {rate}, {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if kind == "fixed":
        return np.full(n, 1.0 / rate)
    if kind == "poisson":
        burstiness = 1.0
    elif kind != "gamma":
        raise ConfigError(f"unknown arrival kind {kind!r} (poisson, gamma, fixed)")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, kind: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0, normalize: bool = True) -> np.ndarray:
    """Send times of ``n`` requests, seconds after the start, non-decreasing, shape ``[n]``."""
    times = np.cumsum(arrival_gaps(n, rate, kind, burstiness, seed))
    if normalize and n and not math.isinf(rate) and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times
