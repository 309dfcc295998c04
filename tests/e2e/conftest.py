"""End-to-end fixtures: real clusters started through the launcher, the reference engine, and
helpers to read every worker's Stats over gRPC."""

from __future__ import annotations

import json
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
from tests.e2e import cluster_starts

NUM_BLOCKS = 512  # per worker: 8192 tokens, enough for 16 concurrent short requests

# Clusters shared by every module that asks for the same name (start_cluster options): started on
# first use, stopped after the last selected test that uses one, or at the end of the session. A
# module hands one to its tests only with every pool full. A test that kills or drains workers,
# changes membership or needs other flags starts its own cluster instead.
SHARED = {
    "1p1d-auto": dict(num_prefill=1, num_decode=1, transfer_engine="auto"),   # shm on one host
    "2p2d-tcp": dict(num_prefill=2, num_decode=2, transfer_engine="tcp"),
    "0p1d-colocated": dict(num_prefill=0, num_decode=1, serving_mode="colocated"),
}
TOPOLOGIES = ("1p1d-auto", "2p2d-tcp")   # the `cluster` fixture's, for modules that do not define one

def start_cluster(log_dir: Path, **overrides) -> Cluster:
    settings = dict(http_port=0, registry_port=0, weights="fp32", num_blocks=NUM_BLOCKS, log_dir=str(log_dir),
                    startup_timeout_s=240, grace_s=15)   # fp32: the reference mode the token checks use
    config = LauncherConfig(**{**settings, **overrides})
    cluster_starts.started += 1
    print(f"\n[e2e] cluster #{cluster_starts.started} starting: {overrides}", flush=True)
    return Cluster(config).start()


def stop_cluster(cluster: Cluster) -> None:
    cluster.stop()
    leftovers = [c.name for c in cluster.children if c.alive()]
    assert not leftovers, f"still running after stop: {leftovers}"
    for c in cluster.children:
        assert not Path(f"/proc/{c.pid}").exists() or _is_zombie_free(c.pid), c.name


def _is_zombie_free(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return True


def shared_name(item: pytest.Item) -> str | None:
    """The `SHARED` cluster ``item`` runs on: its ``cluster`` fixture's parameter, if a name there."""
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("cluster") if callspec is not None and "cluster" in item.fixturenames else None
    return name if name in SHARED else None


class SharedClusters:
    """The session's `SHARED` clusters. ``get`` starts one on first use; ``done`` (after each
    test) stops one no later selected test uses; ``close`` stops the rest."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, users: dict[str, int]) -> None:
        self._tmp = tmp_path_factory
        self._users = dict(users)        # name -> selected tests still to run on it
        self._running: dict[str, Cluster] = {}

    def get(self, name: str) -> Cluster:
        """The running cluster ``name``, every pool full (what earlier modules left has drained)."""
        if name not in self._running:
            self._running[name] = start_cluster(self._tmp.mktemp(name), **SHARED[name])
        c = self._running[name]
        assert_pools_full(c, timeout_s=60)
        return c

    def done(self, name: str) -> None:
        self._users[name] -= 1
        if self._users[name] <= 0 and name in self._running:
            stop_cluster(self._running.pop(name))

    def close(self) -> None:
        errors = []
        while self._running:
            name, c = self._running.popitem()
            try:
                stop_cluster(c)
            except Exception as exc:  # stop the others, then report
                errors.append(f"{name}: {exc!r}")
        assert not errors, f"shared clusters did not stop cleanly: {errors}"


_pool: list[SharedClusters] = []   # the session's, while it runs (for pytest_runtest_teardown)


@pytest.fixture(scope="session")
def shared_clusters(request, tmp_path_factory):
    users: dict[str, int] = {}
    for item in request.session.items:
        name = shared_name(item)
        if name is not None:
            users[name] = users.get(name, 0) + 1
    pool = SharedClusters(tmp_path_factory, users)
    _pool.append(pool)
    yield pool
    _pool.remove(pool)
    pool.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    name = shared_name(item)
    if name is not None and _pool:
        _pool[0].done(name)
    return result


def pytest_terminal_summary(terminalreporter):
    if cluster_starts.started:
        terminalreporter.write_line(f"e2e: {cluster_starts.started} clusters started")


@pytest.fixture(scope="module", params=TOPOLOGIES)
def cluster(request, shared_clusters):
    """A running shared cluster per topology (`SHARED`; each module gets it with its pools full)."""
    c = shared_clusters.get(request.param)
    c.topology = request.param
    return c


@pytest.fixture(scope="session")
def engine_run(smollm):
    """``engine_run(token_ids, params) -> GenerationResult`` from the single-process engine
    (``params``: an `engine.sampling.SamplingParams`), cached."""
    from engine.config import CacheConfig
    from engine.loader import build_generator

    gen = build_generator(smollm, CacheConfig(num_blocks=256))
    cache: dict = {}

    def run(token_ids, params):
        key = (tuple(token_ids), params)
        if key not in cache:
            cache[key] = gen.generate([list(token_ids)], params)[0]
        return cache[key]

    return run


@pytest.fixture(scope="session")
def reference(engine_run):
    """``reference(token_ids, max_tokens, stop=()) -> GenerationResult`` from the single-process
    engine (greedy)."""
    from engine.sampling import SamplingParams

    def run(token_ids, max_tokens, stop=()):
        return engine_run(token_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=tuple(stop)))

    return run


@pytest.fixture(scope="session")
def tokenizer(smollm):
    return smollm.tokenizer


def openai_client(cluster: Cluster):
    import openai

    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=180)


def worker_stats(cluster: Cluster) -> dict[str, tuple[str, pb.StatsResponse]]:
    """worker id -> (role, StatsResponse), read over gRPC from the addresses /admin/workers lists."""
    members = httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()
    md = control_metadata(RouterConfig())
    out = {}
    for m in members:
        with grpc.insecure_channel(m["grpc_address"]) as ch:
            stub = (pbg.PrefillStub if m["role"] == "prefill" else pbg.DecodeStub)(ch)
            out[m["id"]] = (m["role"], stub.Stats(pb.StatsRequest(), timeout=10, metadata=md))
    return out


def assert_pools_full(cluster: Cluster, timeout_s: float = 20.0, num_workers: int | None = None) -> None:
    """Every worker's KV pool is back to all-free (waits briefly: aborts release asynchronously).
    ``num_workers``: how many members to expect (default: all the cluster started)."""
    expected = num_workers or cluster.config.num_prefill + cluster.config.num_decode
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(cluster)
        busy = {wid: (s.load.free_blocks, s.load.total_blocks, s.load.running, s.load.waiting)
                for wid, (_, s) in stats.items()
                if s.load.free_blocks != s.load.total_blocks or s.load.running or s.load.waiting}
        if not busy and len(stats) == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not back in the pools (free, total, running, waiting): {busy}")
        time.sleep(0.2)


def stream_then_disconnect(cluster: Cluster, body: dict, chunks: int = 5) -> int:
    """POST ``body`` (``stream: true``) to /v1/completions, read ``chunks`` SSE chunks, then close
    the connection mid-stream; returns the chunks read (fewer if the stream ended first)."""
    got = 0
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{cluster.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    got += 1
                    if got == chunks:
                        break  # leaving the block closes the connection mid-stream
    return got
