"""The cluster over verbs on a real RDMA stack (Soft-RoCE in the lab; rdma marker): the cluster
``pdserve up --transfer-engine verbs`` starts (router, 1 prefill, 1 decode as separate processes,
through the launcher ``pdserve up`` runs) answers greedy prompts exactly as the single-process
engine does; a prompt that extends an earlier one is written over verbs only past the blocks the
decode worker's prefix cache holds (delta transfer, ``--prefix-caching``); then kill -9 of the
prefill worker mid-transfer frees the decode worker's blocks only
once the writer is reported lost, which the verbs engine does only after destroying that writer's
QPs (test_verbs_engine.py checks that ordering). One cluster serves the three tests, in this
order: under the lab's emulated CPU each process start costs about a minute (importing torch).

The cluster serves the lab's small checkpoint (`tests.lab_checkpoint`: a Llama with grouped-query
attention and a byte-level tokenizer, loaded as a Hugging Face directory) rather than SmolLM2,
whose loading and decode steps cost minutes there; the reference is the single-process engine on
the same checkpoint. SmolLM2's cluster runs the same path over tcp and shm on the host
(test_serving.py, test_delta_transfer.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy.launcher import Cluster, LauncherConfig
from tests.e2e.conftest import openai_client
from tests.lab_checkpoint import write_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.rdma, pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "lab-llama"   # the checkpoint directory's name, which the router serves it as
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
STARTUP_S = 900   # three torch processes start under CPU emulation in the lab
BLOCK_SIZE = 4    # small blocks: a short prompt fills several


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


def _assert_greedy(url: str, reference) -> None:
    client = openai_client(_Url(url))
    for prompt in PROMPTS:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == reference(prompt), prompt


def _decode_counters(url: str) -> dict:
    """The decode worker's Stats counters and load (asked directly: a killed prefill worker is
    still listed until the router declares it dead)."""
    import grpc

    from router.config import RouterConfig
    from router.server import control_metadata
    from rpc import pdserve_pb2 as pb
    from rpc import pdserve_pb2_grpc as pbg

    member = next(m for m in httpx.get(f"{url}/admin/workers", timeout=30).json() if m["role"] == "decode")
    with grpc.insecure_channel(member["grpc_address"]) as channel:
        s = pbg.DecodeStub(channel).Stats(pb.StatsRequest(), timeout=30, metadata=control_metadata(RouterConfig()))
    return dict(s.counters) | {"free": s.load.free_blocks, "total": s.load.total_blocks,
                               "reserved": s.load.reserved_blocks}


@pytest.fixture(scope="module")
def lab_model(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("lab-model") / MODEL)


@pytest.fixture(scope="module")
def reference(lab_model):
    """``reference(prompt) -> str``: the single-process engine's greedy text (``MAX_TOKENS``) on
    the lab checkpoint (float32, the cluster's block size); ``reference.tokenizer`` its tokenizer."""
    from engine.config import CacheConfig
    from engine.loader import build_generator, load_model
    from engine.sampling import SamplingParams

    loaded = load_model(str(lab_model), weights="fp32")
    gen = build_generator(loaded, CacheConfig(num_blocks=1024, block_size=BLOCK_SIZE))

    def run(prompt: str) -> str:
        ids = loaded.tokenizer.encode(prompt)
        return gen.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text

    run.tokenizer = loaded.tokenizer
    return run


@pytest.fixture(scope="module")
def verbs_cluster(tmp_path_factory, lab_model):
    log_dir = tmp_path_factory.mktemp("verbs-cluster")
    config = LauncherConfig(http_port=0, registry_port=0, model=str(lab_model), weights="fp32", num_blocks=1024,
                            log_dir=str(log_dir),
                            transfer_engine="verbs", startup_timeout_s=STARTUP_S, grace_s=20,
                            # one attempt: a retry after the kill would reserve blocks that the dead
                            # prefill never wrote, which stay quarantined by design (no writer known)
                            router_args=("--prefill-timeout-s", "600", "--max-attempts", "1"),
                            # --kv-send layer: a prompt's writes are posted layer by layer through
                            # its pass (seconds in the lab), so the kill below lands mid-transfer;
                            # the CPU default (pass) posts them in one burst after the pass
                            worker_args=("--quarantine-s", "240", "--prefill-timeout-s", "200",
                                         "--transfer-timeout-s", "200", "--prefix-caching",
                                         "--block-size", str(BLOCK_SIZE), "--kv-send", "layer"))
    cluster = Cluster(config).start()
    yield cluster
    cluster.stop()


def test_pdserve_up_over_verbs_answers_like_the_single_process_engine(verbs_cluster, reference):
    url = verbs_cluster.url
    workers = httpx.get(f"{url}/admin/workers", timeout=30).json()
    assert {(w["role"], w["transfer_engine"], w["state"]) for w in workers} == {
        ("prefill", "verbs", "CONNECTED"), ("decode", "verbs", "CONNECTED")}
    _assert_greedy(url, reference)
    counters = _decode_counters(url)
    assert counters["kv_writes_received"] > 0 and counters["free"] == counters["total"]
    assert "verbs engine on rxe" in (verbs_cluster.log_dir / "decode-0.log").read_text()


def test_a_longer_prompt_is_written_only_past_the_blocks_the_decode_worker_holds(verbs_cluster, reference):
    url = verbs_cluster.url
    client = openai_client(_Url(url))
    base = "Soft-RoCE runs the RDMA transport over an ordinary Ethernet device."   # 69 tokens (bytes)
    ids = reference.tokenizer.encode(base)
    first = client.completions.create(model=MODEL, prompt=base, max_tokens=MAX_TOKENS, temperature=0)
    assert first.choices[0].text == reference(base)
    before = _decode_counters(url)
    longer = base + first.choices[0].text + " Why does that matter?"
    second = client.completions.create(model=MODEL, prompt=longer, max_tokens=MAX_TOKENS, temperature=0)
    assert second.choices[0].text == reference(longer)
    after = _decode_counters(url)
    held = after["blocks_held_at_reserve"] - before["blocks_held_at_reserve"]
    assert held >= (len(ids) - 1) // BLOCK_SIZE >= 3                          # not sent again
    assert after["kv_writes_received"] > before["kv_writes_received"]        # the rest came over verbs
    assert after["free"] == after["total"]


def test_kill9_prefill_mid_transfer_frees_decode_blocks_only_after_its_qps_are_gone(verbs_cluster):
    """The prefill worker is killed while the KV of a prompt is arriving; the decode worker frees
    the request's blocks when the writer's loss is reported (its QPs destroyed first), long
    before the 240 s quarantine, and no write lands after that."""
    cluster = verbs_cluster
    before = _decode_counters(cluster.url)
    prompt = " ".join(["The history of the city and its people is long."] * 30)   # 1469 tokens (bytes)
    result: dict = {}

    def ask() -> None:
        try:
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=900,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
            result["status"] = r.status_code
        except httpx.HTTPError as exc:
            result["error"] = str(exc)

    client = threading.Thread(target=ask, name="long-request")
    client.start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:   # the prompt's KV writes are arriving
        now = _decode_counters(cluster.url)
        if now["reserved"] > 0 and now["kv_writes_received"] > before["kv_writes_received"]:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the prompt's KV never started arriving")
    cluster.workers[0].popen.kill()   # prefill-0, mid-transfer
    killed_at = time.monotonic()
    while True:   # freed by the writer's loss, not by the quarantine timer
        now = _decode_counters(cluster.url)
        if now["free"] == now["total"] and now["reserved"] == 0:
            break
        assert time.monotonic() - killed_at < 120, now
        time.sleep(0.2)
    assert now["transfers_failed"] > before.get("transfers_failed", 0)
    settled = now["kv_writes_received"]
    time.sleep(2.0)
    assert _decode_counters(cluster.url)["kv_writes_received"] == settled   # nothing lands after
    client.join(900)
    assert result.get("status") != 200   # its only prefill worker died
