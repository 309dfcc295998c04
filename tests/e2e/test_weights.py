"""``pdserve up --weights native``: the GGUF's 4-bit projections on both sides of the split. The
prefill worker computes the prompt's KV with native weights, the decode worker continues with
them, and the greedy answers equal the single-process engine's with the same weights: every
process reads the plan (which kernel runs how many rows) the first one timed (`engine.tuning`),
so all three round alike."""

from __future__ import annotations

import httpx
import pytest

from engine.quant import int4_kernel_available
from tests.e2e.conftest import assert_pools_full, start_cluster, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers greater than 100."]


@pytest.fixture(scope="module")
def native_engine():
    from engine.config import CacheConfig
    from engine.loader import build_generator, load_model

    if not int4_kernel_available():
        pytest.skip("this torch build has no working CPU int4 kernel")
    loaded = load_model(weights="native")
    return loaded, build_generator(loaded, CacheConfig(num_blocks=128, dtype=loaded.kv_dtype))


def test_native_cluster_answers_like_the_native_engine(native_engine, tmp_path):
    from engine.sampling import SamplingParams

    loaded, gen = native_engine
    cluster = start_cluster(tmp_path, num_prefill=1, num_decode=1, transfer_engine="tcp", weights="native")
    try:
        for prompt in PROMPTS:
            want = gen.generate([loaded.tokenizer.encode(prompt)], SamplingParams(max_tokens=24, temperature=0.0))[0]
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=300,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.text
        assert "weights native" in (cluster.log_dir / "prefill-0.log").read_text()
        for n, (kernel, rows) in loaded.model.low_bit_plans.items():   # the reference's, read back
            plan = f"through the {kernel} kernel up to {rows} rows on {n} thread(s) (read from "
            for worker in ("prefill-0", "decode-0"):
                assert plan in (cluster.log_dir / f"{worker}.log").read_text(), worker
        assert_pools_full(cluster)
    finally:
        stop_cluster(cluster)
