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


def _self_signed(d, name: str) -> list[str]:
    """[cert, key, ca] of a self-signed certificate (its own CA) valid for 127.0.0.1."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(d / f"{name}-key.pem"), "-out", str(d / f"{name}.pem")],
                   check=True, capture_output=True)
    return [str(d / f"{name}.pem"), str(d / f"{name}-key.pem"), str(d / f"{name}.pem")]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        unavailable("openssl", "openssl is not installed (needed to make a test certificate)")
    d = tmp_path_factory.mktemp("tls")
    return _self_signed(d, "pdserve-test"), _self_signed(d, "another-ca")


def test_cluster_over_tls_serves_and_refuses_plaintext_and_strangers(certs, tmp_path):
    """Mutual TLS: the cluster serves; a plaintext client, a TLS client without a certificate and
    one whose certificate another CA signed are all refused at the handshake."""
    (cert, key, ca), (other_cert, other_key, _) = certs
    flags = ("--tls-cert", cert, "--tls-key", key, "--tls-ca", ca)
    config = LauncherConfig(http_port=0, registry_port=0, weights="fp32", num_blocks=256, log_dir=str(tmp_path),
                            router_args=flags, worker_args=flags, startup_timeout_s=240)
    with Cluster(config).start() as cluster:
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        address = f"127.0.0.1:{cluster.registry_port}"
        workers = [w["grpc_address"] for w in httpx.get(f"{cluster.url}/admin/workers", timeout=10).json()]
        ca_pem = open(ca, "rb").read()
        strangers = {
            "plaintext": None,
            "no client certificate": grpc.ssl_channel_credentials(ca_pem),
            "certificate of another CA": grpc.ssl_channel_credentials(
                ca_pem, open(other_key, "rb").read(), open(other_cert, "rb").read()),
        }
        for target in [address, *workers]:
            for name, creds in strangers.items():
                ch = grpc.insecure_channel(target) if creds is None else grpc.secure_channel(target, creds)
                with ch, pytest.raises(grpc.RpcError) as err:
                    pbg.RegistryStub(ch).Heartbeat(pb.HeartbeatRequest(worker_id="x"), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (target, name, err.value)
