"""Prometheus metrics of the router, on a registry of their own (one per app, so tests can build
several apps in one process).

Latencies are in seconds: TTFT from request arrival (after validation) to the first token,
ITL between successive tokens (a chunk of n tokens counts n gaps of gap/n), E2E to the last
token. KV transfer figures come from each PrefillResponse. Per-worker load gauges are read from
the membership table at scrape time, so a gone worker's series disappear with it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.membership import Membership

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                    2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    """All the router's metrics. ``render()`` gives the text exposition format."""

    def __init__(self, membership: Membership | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency, end to end",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("pdserve_prefill_compute_seconds",
                                         "Prefill compute time per request",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV cache bytes written prefill->decode",
                                registry=r)
        self.kv_bytes_skipped = Counter("pdserve_kv_transfer_bytes_skipped",
                                        "KV cache bytes not written: the decode worker held those "
                                        "blocks in its prefix cache (delta transfer)", registry=r)
        self.prefill_warmups = Counter("pdserve_prefill_warmups", "Prefix-cache warm-ups sent to prefill "
                                       "workers after a request finished (router.warmup), by outcome",
                                       ["outcome"], registry=r)
        self.prefill_warmup_tokens = Counter("pdserve_prefill_warmup_tokens", "Tokens prefill workers "
                                             "computed into their prefix cache in warm-ups", registry=r)
        self.prefix_query_tokens = Counter("pdserve_prefix_cache_queries", "Prompt tokens looked up "
                                           "in a worker's prefix cache", ["role"], registry=r)
        self.prefix_hit_tokens = Counter("pdserve_prefix_cache_hits", "Prompt tokens found in a "
                                         "worker's prefix cache (prefill: not computed; decode: not "
                                         "received)", ["role"], registry=r)
        self.kv_seconds = Histogram("pdserve_kv_transfer_seconds", "KV transfer time per request",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("pdserve_queue_depth", "Requests waiting for KV blocks", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served", registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests",
                                ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("pdserve_request_errors", "Requests failed with an error",
                              ["code"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.retries = Counter("pdserve_request_retries", "Placements retried on another pair",
                               registry=r)
        self.migrations = Counter("pdserve_request_migrations",
                                  "Retries of requests that had already streamed tokens (resumed "
                                  "by re-prefilling prompt + generated tokens on a new pair)", registry=r)
        self.requests_by_path = Counter("pdserve_requests_by_path", "Requests by serving path "
                                        "(disaggregated | colocated)", ["path"], registry=r)
        if membership is not None:
            r.register(_WorkerLoadCollector(membership))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerLoadCollector:
    _FIELDS = ("free_blocks", "total_blocks", "running", "waiting", "queued_prompt_tokens",
               "reserved_blocks")

    def __init__(self, membership: Membership):
        self._m = membership

    def describe(self):
        return []

    def collect(self):
        events = CounterMetricFamily("pdserve_membership_events", "Workers joining, re-joining, "
                                     "leaving, declared dead, refused", labels=["event"])
        for name, count in self._m.events.items():
            events.add_metric([name], count)
        yield events
        families = {f: GaugeMetricFamily(f"pdserve_worker_{f}", f"Worker load: {f}",
                                         labels=["worker_id", "role"]) for f in self._FIELDS}
        state = GaugeMetricFamily("pdserve_worker_state",
                                  "Worker state (0 joining, 1 connected, 2 draining)",
                                  labels=["worker_id", "role"])
        cached = GaugeMetricFamily("pdserve_worker_prefix_cache_blocks", "Blocks in a worker's "
                                   "prefix cache (the router's KV index of it)", labels=["worker_id", "role"])
        evicted = CounterMetricFamily("pdserve_worker_prefix_cache_evictions", "Blocks evicted from a "
                                      "worker's prefix cache since it registered", labels=["worker_id", "role"])
        tp = GaugeMetricFamily("pdserve_worker_tensor_parallel_size", "Processes (TP ranks) a worker's model "
                               "is sharded over", labels=["worker_id", "role"])
        sizes, evictions = self._m.kv_index.sizes(), dict(self._m.kv_index.evictions)
        for m in self._m.members():
            for f, fam in families.items():
                fam.add_metric([m.worker_id, m.role], float(getattr(m.load, f)))
            state.add_metric([m.worker_id, m.role], float(m.state))
            tp.add_metric([m.worker_id, m.role], float(m.tensor_parallel_size))
            if m.worker_id in sizes:
                cached.add_metric([m.worker_id, m.role], float(sizes[m.worker_id]))
                evicted.add_metric([m.worker_id, m.role], float(evictions.get(m.worker_id, 0)))
        yield from families.values()
        yield state
        yield tp
        yield cached
        yield evicted
