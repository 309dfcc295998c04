"""`loadtest.compare` helpers (workload, per-class statistics, table) and the launcher's
serving-mode and CPU-pinning options."""

from __future__ import annotations

import math

import pytest

from deploy.launcher import Cluster, LauncherConfig
from loadtest.compare import class_stats, deployments, mixed_requests, table

pytestmark = pytest.mark.unit


def test_mixed_requests_split_and_reproducible():
    reqs = mixed_requests(10, 100, 10, 0.5, 64, 128, seed=3)
    assert sorted(r.prompt_len for r in reqs) == [10] * 5 + [100] * 5
    assert all(64 <= r.expected_output_len <= 128 for r in reqs)
    assert reqs == mixed_requests(10, 100, 10, 0.5, 64, 128, seed=3)


def _result(rows):
    return {"input_lens": [r[0] for r in rows], "ttfts": [r[1] for r in rows],
            "latencies": [r[2] for r in rows], "output_lens": [r[3] for r in rows],
            "errors": [r[4] for r in rows], "completed": 2, "failed": 1,
            "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "median_tpot_ms": 3.0, "p99_tpot_ms": 4.0,
            "request_goodput": 0.5, "goodput_ratio": 0.5, "request_throughput": 1.0,
            "output_throughput": 10.0}


def test_class_stats_and_table():
    result = _result([(10, 0.1, 1.1, 11, ""), (1000, 1.0, 3.0, 21, ""), (1000, 0.0, 0.0, 0, "boom")])
    stats = class_stats(result, 500)
    assert stats["short"]["count"] == 1 and stats["long"]["count"] == 1
    assert stats["short"]["p50_ttft_ms"] == pytest.approx(100.0)
    assert stats["long"]["p50_tpot_ms"] == pytest.approx(100.0)
    lines = table({"a": {"result": result, "by_class": stats}, "b": {"result": result, "by_class": stats}})
    assert "disaggregated" not in lines[0] and lines[0].split() == ["a", "b"]
    assert any(line.startswith("goodput") for line in lines)
    assert math.isnan(class_stats(_result([]), 500)["short"]["p50_ttft_ms"])


def test_deployments_use_the_same_number_of_workers():
    deps = deployments(256)
    assert {d.workers for d in deps.values()} == {2}
    assert "--prefill" in deps["colocated"].up_args and "0" in deps["colocated"].up_args


def test_launcher_serving_modes_and_pinning(tmp_path):
    with pytest.raises(ValueError, match="prefill"):
        LauncherConfig(num_prefill=0)
    with pytest.raises(ValueError, match="auto"):
        LauncherConfig(colocated_threshold_tokens=64)
    with pytest.raises(ValueError, match="cpu_affinity"):
        LauncherConfig(cpu_affinity=(10_000,))
    with pytest.raises(ValueError, match="weights"):
        LauncherConfig(weights="int4")
    native = Cluster(LauncherConfig(weights="native", log_dir=str(tmp_path)))
    assert all(w.argv[w.argv.index("--weights") + 1] == "native" for w in native.workers)
    c = Cluster(LauncherConfig(num_prefill=0, num_decode=3, serving_mode="colocated",
                               cpu_affinity=(0,), log_dir=str(tmp_path)))
    assert [w.name for w in c.workers] == ["decode-0", "decode-1", "decode-2"]
    assert c.cpus == {"decode-0": (0,), "decode-1": (0,), "decode-2": (0,)}
    argv = c.router.argv
    assert argv[argv.index("--serving-mode") + 1] == "colocated"
    # a worker of N threads is pinned to N CPUs: one worker of two threads on two CPUs gets both
    one = Cluster(LauncherConfig(num_prefill=0, num_decode=1, serving_mode="colocated", threads=2,
                                 cpu_affinity=(0, 1), log_dir=str(tmp_path)))
    assert one.cpus == {"decode-0": (0, 1)} and one.oversubscribed() == set()
    three = Cluster(LauncherConfig(num_decode=2, threads=2, cpu_affinity=(0, 1), log_dir=str(tmp_path)))
    assert three.cpus == {"prefill-0": (0, 1), "decode-0": (0, 1), "decode-1": (0, 1)}   # cycling


def test_launcher_gives_workers_sharing_cpus_the_passive_wait(tmp_path, monkeypatch):
    """Workers whose torch threads outnumber the CPUs they share run with OMP_WAIT_POLICY=PASSIVE
    (`Cluster.oversubscribed`); one thread per pinned CPU, or one process's threads on its own
    CPUs, keep libgomp's spinning."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})

    def cluster(**kw):
        return Cluster(LauncherConfig(log_dir=str(tmp_path), **kw))

    assert cluster(cpu_affinity=(0, 1)).oversubscribed() == set()               # pdserve up's default
    assert cluster(cpu_affinity=(0, 1), threads=2).oversubscribed() == {"prefill-0", "decode-0"}
    assert cluster(threads=2).oversubscribed() == {"prefill-0", "decode-0"}     # 4 threads, 2 CPUs
    assert cluster(threads=1).oversubscribed() == set()
    assert cluster(num_prefill=0, num_decode=1, serving_mode="colocated", threads=2).oversubscribed() == set()
    assert cluster(num_prefill=0, num_decode=1, serving_mode="colocated", threads=2,
                   decode_tp=(2,)).oversubscribed() == {"decode-0"}
    spawned = {}

    def popen(argv, env=None, **kw):
        spawned[argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "router"] = env
        raise OSError("not started: this test only reads the environment")

    monkeypatch.setattr("subprocess.Popen", popen)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    c = cluster(threads=2)
    for child in c.workers:
        with pytest.raises(OSError):
            c._spawn(child)
    assert {n: e.get("OMP_WAIT_POLICY") for n, e in spawned.items()} == {"prefill-0": "PASSIVE", "decode-0": "PASSIVE"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")   # the user's own setting wins
    with pytest.raises(OSError):
        c._spawn(c.workers[0])
    assert "OMP_WAIT_POLICY" not in spawned["prefill-0"]
