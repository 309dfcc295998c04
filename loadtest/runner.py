"""Run one benchmark: the lifecycle of a load test against one URL.

1. Build the workload (``datasets``) and the send schedule (``arrivals``), both seeded.
2. Ready check: the first request is sent alone; if it fails, ``ServerError`` and nothing else
   is sent (skip with ``ready_check=False``).
3. Main run: the clock starts; each request is launched at its scheduled time, waits for a slot
   when ``max_concurrency`` is set (vLLM's semaphore semantics: the rate schedules arrivals, the
   cap limits what runs), and streams its answer (``client``).
4. Bounded: nothing is launched after ``max_duration_s``; requests still in flight then are
   cancelled and recorded as failed ("max duration reached"); requests never sent are left out.
5. Metrics over what was sent (``metrics``), plus the run's configuration in the result dict.

Only ``config.url`` is ever contacted; proxies from the environment are ignored.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime
from typing import Callable

import httpx
from tqdm import tqdm

from loadtest.arrivals import arrival_times
from loadtest.client import RequestOutput, build_payload, send_request
from loadtest.config import BenchmarkConfig
from loadtest.datasets import sample_requests
from loadtest.errors import ServerError
from loadtest.metrics import compute_metrics
from loadtest.sample import SampleRequest, approx_token_count

DEADLINE_ERROR = "max duration reached"


def make_client(config: BenchmarkConfig) -> httpx.AsyncClient:
    """An HTTP client for ``config``: its timeout, headers, a pool as large as the concurrency."""
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s), limits=limits,
                             headers=config.headers, trust_env=False)


async def ready_check(client: httpx.AsyncClient, config: BenchmarkConfig,
                      sample: SampleRequest) -> RequestOutput:
    """Send ``sample`` once (bounded by ``max_duration_s``); raises ``ServerError`` with the
    server's answer if it fails."""
    output = RequestOutput(prompt_len=sample.prompt_len)
    try:
        await asyncio.wait_for(send_request(client, config.url, build_payload(config, sample),
                                            output), config.max_duration_s)
    except asyncio.TimeoutError:
        output.error = DEADLINE_ERROR
    if not output.success:
        raise ServerError(f"ready check against {config.url} failed: {output.error}")
    return output


class _Run:
    """The main phase of one run (step 3 and 4 of the module docstring)."""

    def __init__(self, config: BenchmarkConfig, client: httpx.AsyncClient, total: int):
        self.config, self.client = config, client
        self.slots = asyncio.Semaphore(config.max_concurrency or max(total, 1))
        self.bar = tqdm(total=total, disable=not config.progress, unit="req", leave=False)
        self.origin = time.perf_counter()
        self.deadline = self.origin + config.max_duration_s

    async def one(self, sample: SampleRequest) -> RequestOutput | None:
        async with self.slots:
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0:
                return None
            output = RequestOutput(prompt_len=sample.prompt_len)
            body = build_payload(self.config, sample)
            try:
                await asyncio.wait_for(send_request(self.client, self.config.url, body, output),
                                       remaining)
            except asyncio.TimeoutError:
                output.success, output.error = False, DEADLINE_ERROR
            self.bar.update(1)
            return output

    async def run(self, requests: list[SampleRequest], times: list[float]) -> list[RequestOutput]:
        tasks = []
        for sample, at in zip(requests, times):
            send_at = self.origin + at
            if send_at >= self.deadline:
                break
            delay = send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(sample)))
        outputs = await asyncio.gather(*tasks)
        self.bar.close()
        return [o for o in outputs if o is not None]


async def run_benchmark_async(config: BenchmarkConfig,
                              requests: list[SampleRequest] | None = None,
                              count_tokens: Callable[[str], int] = approx_token_count) -> dict:
    """Run the benchmark ``config`` describes and return its result dict (see ``metrics`` for
    the fields; the configuration is merged in under vLLM's names). ``requests`` overrides the
    dataset. Raises ``ServerError`` if the ready check fails, ``DatasetError`` for a bad dataset."""
    if requests is None:
        requests = sample_requests(config, count_tokens)
    times = arrival_times(len(requests), config.request_rate, config.arrival, config.burstiness,
                          config.seed).tolist()
    async with make_client(config) as client:
        if config.ready_check and requests:
            await ready_check(client, config, requests[0])
        run = _Run(config, client, len(requests))
        outputs = await run.run(requests, times)
        duration = time.perf_counter() - run.origin
    result = config_fields(config)
    result.update(compute_metrics(outputs, duration, run.origin, config.percentile_metrics,
                                  config.metric_percentiles, config.goodput_slos_ms))
    return result


def run_benchmark(config: BenchmarkConfig, requests: list[SampleRequest] | None = None,
                  count_tokens: Callable[[str], int] = approx_token_count) -> dict:
    """Blocking ``run_benchmark_async`` (starts its own event loop)."""
    return asyncio.run(run_benchmark_async(config, requests, count_tokens))


def config_fields(config: BenchmarkConfig) -> dict:
    """The run's settings as vLLM's result JSON names them, plus this harness's own."""
    chat = config.endpoint == "/v1/chat/completions"
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if chat else "openai",
        "backend": "openai-chat" if chat else "openai",
        "label": config.label,
        "model_id": config.model,
        "tokenizer_id": None,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "dataset_name": config.dataset,
        "arrival": config.arrival,
        "seed": config.seed,
        "max_duration_s": config.max_duration_s,
        "goodput": dict(config.goodput_slos_ms) or None,
    }
