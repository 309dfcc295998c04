"""gRPC over TLS when certificates are given: a whole cluster (router, prefill, decode) with TLS
on every control-plane connection serves a request; a plaintext client cannot talk to it."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import httpx
import pytest

from tests.require import unavailable

from deploy.launcher import Cluster, LauncherConfig
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        unavailable("openssl", "openssl is not installed (needed to make a test certificate)")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=pdserve-test", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return [str(d / "cert.pem"), str(d / "key.pem"), str(d / "cert.pem")]


def test_cluster_over_tls_serves_and_refuses_plaintext(certs, tmp_path):
    cert, key, ca = certs
    flags = ("--tls-cert", cert, "--tls-key", key, "--tls-ca", ca)
    config = LauncherConfig(http_port=0, registry_port=0, num_blocks=256, log_dir=str(tmp_path),
                            router_args=flags, worker_args=flags, startup_timeout_s=240)
    with Cluster(config).start() as cluster:
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with grpc.insecure_channel(f"127.0.0.1:{cluster.registry_port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                pbg.RegistryStub(ch).Heartbeat(pb.HeartbeatRequest(worker_id="x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
