"""API fuzzing with schemathesis (the standard OpenAPI fuzzer) against a live router with real
workers: for every operation of the router's own OpenAPI schema, requests generated valid
(positive) and invalid (negative). No answer may be a 5xx, except a 503 of admission control
(overloaded / capacity_timeout / no_workers), and every error answer must be an OpenAI error
object. (Schemathesis's own pytest plugin cannot load a schema from a fixture under pytest 9, so
the test drives its Hypothesis strategies itself, one operation and mode at a time.)"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.e2e.conftest import assert_pools_full, start_cluster, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_EXAMPLES = 40            # per operation and generation mode
ADMISSION_503 = {"overloaded", "capacity_timeout", "no_workers"}


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("fuzz"), num_prefill=1, num_decode=1, transfer_engine="auto",
                      router_args=("--max-tokens-limit", "16"))
    yield c
    stop_cluster(c)


def _is_openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] != "" and isinstance(err["type"], str))


def _problem(case, response) -> str | None:
    """Why this answer breaks the contract, or None."""
    status, text = response.status_code, response.text
    content_type = response.headers.get("content-type") or [""]   # schemathesis: name -> [values]
    body = json.loads(text) if content_type[0].startswith("application/json") else None
    where = f"{case.method} {case.path} {str(case.body)[:200]!r} -> {status}: {text[:300]}"
    if status >= 500 and not (status == 503 and body and body.get("error", {}).get("code") in ADMISSION_503):
        return "server error: " + where
    if status >= 400 and not _is_openai_error(body):
        return "not an OpenAI error body: " + where
    if status == 200 and case.method == "POST" and body is None and "data: [DONE]" not in text:
        return "incomplete stream: " + where
    return None


def test_no_5xx_and_every_error_is_an_openai_error(fuzz_cluster):
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"}
    problems: list[str] = []
    statuses: Counter = Counter()
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(timeout=180)
                statuses[(case.method, case.path, response.status_code)] += 1
                problem = _problem(case, response)
                if problem:
                    problems.append(problem)
            try:
                run()
            except Unsatisfiable:   # an operation with no inputs has no invalid request
                assert mode is GenerationMode.NEGATIVE, f"no valid request for {op.method} {op.path}"
    print(f"\nschemathesis: {sum(statuses.values())} requests over {len(operations)} operations, "
          f"{len(problems)} problems; by status: {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:20])
    for path in ("/v1/completions", "/v1/chat/completions"):   # the fuzzer reached the workers too
        assert statuses[("POST", path, 200)] > 0 and statuses[("POST", path, 400)] > 0, statuses
    assert_pools_full(fuzz_cluster, timeout_s=60)
