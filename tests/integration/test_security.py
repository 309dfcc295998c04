"""The cluster secret and the API key, against a real router process on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from deploy.launcher import free_port
from rpc import PROTOCOL_VERSION
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg
from rpc.auth import client_interceptor

pytestmark = pytest.mark.integration
SECRET = "router-test-secret-0123456789"
API_KEY = "sk-test-key-42"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    d = tmp_path_factory.mktemp("sec")
    http, reg = free_port(), free_port()
    env = dict(os.environ, PDSERVE_SECRET=SECRET, PDSERVE_API_KEY=API_KEY)
    log = open(d / "router.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "router", "--http-port", str(http), "--registry-address",
                             f"127.0.0.1:{reg}", "--wait-for-workers-s", "0"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    end = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (d / "router.log").read_text()
        try:
            httpx.get(f"{url}/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < end, "router did not start"
            time.sleep(0.3)
    yield url, f"127.0.0.1:{reg}", d
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def _register(address: str, secret: str | None) -> pb.RegisterResponse:
    channel = grpc.insecure_channel(address)
    if secret is not None:
        channel = grpc.intercept_channel(channel, client_interceptor(secret.encode()))
    info = pb.WorkerInfo(worker_id="intruder", role=pb.DECODE, grpc_address="127.0.0.1:1",
                         protocol_version=PROTOCOL_VERSION, compat_hash="x")
    return pbg.RegistryStub(channel).Register(pb.RegisterRequest(worker=info), timeout=5)


@pytest.mark.parametrize("secret", [None, "a-different-secret-0123456789"])
def test_unauthenticated_registration_is_refused(router, secret):
    _, registry, _ = router
    with pytest.raises(grpc.RpcError) as err:
        _register(registry, secret)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert httpx.get(f"{router[0]}/admin/workers", headers={"Authorization": f"Bearer {API_KEY}"}).json() == []


def test_worker_with_the_wrong_secret_exits_with_a_clear_error(router):
    _, registry, d = router
    env = dict(os.environ, PDSERVE_SECRET="wrong-secret-for-this-cluster-000")
    res = subprocess.run([sys.executable, "-m", "decode", "--router", registry, "--num-blocks", "16",
                          "--worker-id", "wrong-secret"], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 3
    assert "wrong secret" in res.stderr


def test_api_key_required_when_set(router):
    url = router[0]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    # with the key but no workers: the request itself is judged (503), not the key
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 503
    assert httpx.get(f"{url}/health").status_code == 503  # probes need no key
