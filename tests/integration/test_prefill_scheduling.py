"""The prefill worker's scheduling on the real model (in process, tcp data plane): prompts that
queue together finish shortest first, in passes no larger than the knee, and every one of
them still gets the engine's output and gives its blocks back."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import CacheConfig
from engine.loader import build_generator
from engine.sampling import SamplingParams
from prefill.job import JobState
from tests.integration.test_delta_transfer import decode_all, running_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(smollm):
    # the knee given: a timed one (engine.prefill_knee) depends on the machine
    with running_pair(smollm, dict(num_blocks=160), dict(num_blocks=160, prefill_batch_tokens=128)) as w:
        yield w


def _prompt(smollm, text: str, n: int) -> list[int]:
    ids = smollm.tokenizer.encode(text * (n // 4 + 1))
    return ids[:n]


def test_a_burst_finishes_shortest_first_and_each_output_is_the_engines(pair, smollm):
    prefill, decode = pair
    assert prefill._batch_tokens == 128   # as given: the shorts (105 tokens) fit a pass, "long" does not
    blocker = _prompt(smollm, "The river bends past the mill. ", 400)   # keeps the loop busy
    long_ = _prompt(smollm, "A long account of the harvest season. ", 520)
    shorts = [_prompt(smollm, f"Short note number {i}. ", 30 + 5 * i) for i in range(3)]
    prompts = {"blocker": blocker, "long": long_} | {f"short{i}": p for i, p in enumerate(shorts)}
    finished: list[str] = []
    lock = threading.Lock()
    reservations, jobs = {}, {}
    for rid, prompt in prompts.items():
        reservations[rid] = decode.reserve(rid, len(prompt), PARAMS.max_tokens, prompt)
    for rid, prompt in prompts.items():   # the rest queue while the blocker computes
        r = reservations[rid]
        jobs[rid] = prefill.submit(rid, prompt, PARAMS, "d", r.blocks, r.transfer.slot, r.transfer.generation)
        jobs[rid].add_done_callback(lambda job: (lock.acquire(), finished.append(job.request_id), lock.release()))
        while rid == "blocker" and jobs[rid].state == JobState.QUEUED:
            time.sleep(0.001)
    for job in jobs.values():
        assert job.finished.wait(120)
    # FIFO would run "long" right after the blocker (and, batched, with the shorts); shortest
    # first runs the three shorts (105 tokens: one pass under the knee) before it
    assert finished[0] == "blocker" and finished[-1] == "long", finished
    assert sorted(finished[1:4]) == ["short0", "short1", "short2"]
    gen = build_generator(smollm, CacheConfig(num_blocks=128))
    for rid, prompt in prompts.items():
        tokens = decode_all(decode, rid, jobs[rid].result(), prompt, PARAMS)
        assert tokens == gen.generate([prompt], PARAMS)[0].token_ids, rid
    assert prefill.res.pool.allocator.num_free == prefill.res.pool.num_blocks
    assert decode.res.pool.allocator.num_free == decode.res.pool.num_blocks


def test_the_burst_benchmark_runs_each_policys_passes(smollm):
    from bench.prefill import burst

    res = burst(smollm, [40, 12, 24], cached=16, max_tokens=2048, batch_tokens=48)
    one_pass, one_at_a_time, sched = (res[k]["ttft_s"] for k in ("fifo-one-pass", "fifo-one-at-a-time", "scheduler"))
    assert len(set(one_pass)) == 1                                  # all in one pass: one finish time
    assert one_at_a_time[0] < one_at_a_time[1] < one_at_a_time[2]  # arrival order, a pass each
    # shortest first: 12 and 24 (36 <= 48) share the first pass, 40 runs alone after them
    assert sched[1] == sched[2] < sched[0]
