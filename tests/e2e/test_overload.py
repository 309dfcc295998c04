"""Overload: 1,000 streaming clients at once against a cluster started as ``pdserve up`` starts it
(router + 1 prefill + 1 decode, default pool and limits), in disaggregated mode (every prompt through
the prefill worker's admission; `pdserve up` itself defaults to auto mode).

Every request either completes with the single-process engine's greedy text or is refused with a
503 (OpenAI error body, ``Retry-After``) within a second; no other status. While the storm runs,
Abort round trips to every worker stay under a second (p99). No reservation expires and nothing is
retried (requests wait at the router, not while holding KV). Afterwards every pool is full, the
processes' memory has not run away, and a later request is still exact. A table is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from deploy.launcher import Cluster, LauncherConfig
from router.config import RouterConfig
from router.server import control_metadata
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg
from tests.e2e.conftest import assert_pools_full, stop_cluster, worker_stats

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_CLIENTS = 1000
MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
             "Say hello in Spanish.", "Name a planet.", "What do bees make?",
             "Give me a synonym for fast.", "What is ice made of?"]
RSS_GROWTH_LIMIT_MB = 400


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class AbortProbe(threading.Thread):
    """Sends Abort(unknown id) to every worker every 0.1 s and records the round trips (s)."""

    def __init__(self, members: list[dict]):
        super().__init__(name="abort-probe", daemon=True)
        self.members, self.rtts, self.errors = members, [], []
        self.stop = threading.Event()

    def run(self) -> None:
        md = control_metadata(RouterConfig())
        channels = [(m, grpc.insecure_channel(m["grpc_address"])) for m in self.members]
        stubs = [(pbg.PrefillStub if m["role"] == "prefill" else pbg.DecodeStub)(ch) for m, ch in channels]
        i = 0
        while not self.stop.wait(0.1):
            for stub in stubs:
                i += 1
                t0 = time.monotonic()
                try:
                    stub.Abort(pb.AbortRequest(request_id=f"probe-{i}"), timeout=10, metadata=md)
                    self.rtts.append(time.monotonic() - t0)
                except grpc.RpcError as exc:
                    self.errors.append(str(exc.code()))
        for _, ch in channels:
            ch.close()


@pytest.fixture(scope="module")
def up_cluster(tmp_path_factory):
    """The cluster ``pdserve up --serving-mode disaggregated`` starts: no pool or limit overridden."""
    config = LauncherConfig(http_port=0, registry_port=0, weights="fp32", log_dir=str(tmp_path_factory.mktemp("overload")),
                            startup_timeout_s=240, grace_s=15)
    c = Cluster(config).start()
    yield c
    stop_cluster(c)


def test_a_thousand_streams_complete_or_get_a_fast_503(up_cluster, tokenizer, reference, tmp_path):
    cluster = up_cluster
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS]
    expected = [reference(p, MAX_TOKENS).text for p in prompts]
    requests = [{"prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS} for i in range(NUM_CLIENTS)]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    members = httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()
    rss_before = {c.name: _rss_mb(c.pid) for c in cluster.children}

    probe = AbortProbe(members)
    probe.start()
    client = subprocess.run([sys.executable, "-m", "tests.e2e.overload_client", "--url", cluster.url,
                             "--requests", str(tmp_path / "requests.json"), "--out", str(tmp_path / "out.json")],
                            capture_output=True, text=True, timeout=1200)
    probe.stop.set()
    probe.join(30)
    assert client.returncode == 0, client.stderr[-3000:]
    run = json.loads((tmp_path / "out.json").read_text())
    results = run["results"]
    rss_after = {c.name: _rss_mb(c.pid) for c in cluster.children}

    completed = [i for i, r in enumerate(results) if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    other = [r for r in results if r["status"] not in (200, 503)]
    rtts = sorted(probe.rtts)
    p99 = rtts[int(0.99 * (len(rtts) - 1))] if rtts else float("inf")
    print(f"\noverload: {NUM_CLIENTS} streaming clients at once, {MAX_TOKENS} tokens each, wall {run['wall_s']:.1f} s")
    print("| completed | 503 | other | slowest 503 (s) | wall (s) | abort p99 (ms) | abort max (ms) | aborts |")
    print(f"| {len(completed)} | {len(refused)} | {len(other)} | "
          f"{max((r['t_status'] for r in refused), default=0):.3f} | {run['wall_s']:.1f} | {p99 * 1000:.0f} | "
          f"{rtts[-1] * 1000 if rtts else 0:.0f} | {len(rtts)} |")
    print("| process | RSS before (MB) | RSS after (MB) |")
    for name in rss_before:
        print(f"| {name} | {rss_before[name]:.0f} | {rss_after[name]:.0f} |")

    assert not other, other[:5]
    assert completed, "nothing completed"
    for i in completed:
        r = results[i]
        assert r["error"] is None and r["finish"] is not None, r
        assert r["text"] == expected[i % len(prompts)], (i, r["text"])
    for r in refused:
        assert r["t_status"] < 1.0, r
        assert r["retry_after"] and int(r["retry_after"]) >= 1
        assert r["error"]["error"]["type"] == "service_unavailable"
    assert not probe.errors and p99 < 1.0, (p99, probe.errors[:5])
    for name in rss_before:
        assert rss_after[name] - rss_before[name] < RSS_GROWTH_LIMIT_MB, (name, rss_before, rss_after)

    assert_pools_full(cluster, timeout_s=60)
    for _, (role, s) in worker_stats(cluster).items():
        if role == "decode":
            assert s.counters["reservations_expired"] == 0 and s.counters["transfers_failed"] == 0, s.counters
            assert s.counters["stale_immediates_dropped"] == 0
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    retries = [line for line in metrics.splitlines() if line.startswith("pdserve_request_retries_total")]
    assert retries and float(retries[0].split()[-1]) == 0, retries
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                   json={"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0]
