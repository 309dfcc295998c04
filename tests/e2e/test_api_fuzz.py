"""API fuzzing with schemathesis (the standard OpenAPI fuzzer) against a live router with real
workers: requests generated from the router's own OpenAPI schema, valid and invalid. No answer may
be a 5xx, except a 503 of admission control (overloaded / capacity_timeout / no_workers), and every
error answer must be an OpenAI error object."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.generation import GenerationMode

from tests.e2e.conftest import assert_pools_full, start_cluster, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_EXAMPLES = 40            # per operation and generation mode
ADMISSION_503 = {"overloaded", "capacity_timeout", "no_workers"}


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("fuzz"), num_prefill=1, num_decode=1, transfer_engine="auto",
                      router_args=("--max-tokens-limit", "16"))
    yield c
    assert_pools_full(c, timeout_s=60)
    stop_cluster(c)


@pytest.fixture
def api_schema(fuzz_cluster):
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.url}/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=MAX_EXAMPLES)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def _is_openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] != "" and isinstance(err["type"], str))


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_every_error_is_an_openai_error(case):
    response = case.call(timeout=180)
    status = response.status_code
    body = None
    if response.headers.get("content-type", "").startswith("application/json"):
        body = json.loads(response.text)
    if status >= 500:
        assert status == 503 and body and body["error"]["code"] in ADMISSION_503, (
            f"{case.method} {case.path} -> {status}: {response.text[:500]}")
    if status >= 400:
        assert _is_openai_error(body), f"{case.method} {case.path} -> {status}: {response.text[:500]}"
    if status == 200 and case.path.startswith("/v1/") and case.method == "POST" and body is None:
        assert "data: [DONE]" in response.text, response.text[-300:]   # a complete stream
