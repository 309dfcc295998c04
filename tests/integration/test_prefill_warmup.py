"""Prefix-cache warm-ups on a real prefill worker (in process, the real model, tcp data plane):
after a turn, the prefill worker computes the turn's answer into its cache (`PrefillWorker.warm`)
so the next turn computes only the new message there; the warmed KV is the KV a prefill would
have computed (the next turn's output equals the engine's); warm-ups never hold blocks after
they end, never run when the pool lacks room, and are dropped, not left behind, when the worker
stops.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.errors import CapacityError, InvalidRequestError
from engine.loader import build_generator
from engine.sampling import SamplingParams
from prefill.worker import PrefillWorker
from tests.integration.test_delta_transfer import _run, running_pair
from worker.config import WorkerConfig
from worker.errors import CacheDisabledError, DrainingError, WarmupDropped
from worker.runtime import build_resources

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BS = 16
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prefill_worker(smollm, **kw):
    return build_resources(WorkerConfig(role="prefill", transfer_engine="tcp", **kw), None, smollm)


@pytest.fixture(scope="module")
def pair(smollm):
    with running_pair(smollm, dict(num_blocks=96, prefix_caching=True), dict(num_blocks=96, prefix_caching=True)) as w:
        yield w


@pytest.fixture(scope="module")
def reference(smollm):
    gen = build_generator(smollm, CacheConfig(num_blocks=128))   # no prefix cache
    return lambda prompt: gen.generate([prompt], PARAMS)[0].token_ids


def _warm(prefill, rid, tokens):
    job = prefill.warm(rid, tokens)
    assert job.finished.wait(120)
    return job


def test_a_warmed_answer_is_not_computed_again_by_the_next_turn(pair, smollm, reference):
    prefill, decode = pair
    tk = smollm.tokenizer
    alloc = prefill.res.pool.allocator
    turn1 = tk.encode(tk.apply_chat_template([{"role": "user", "content": "Describe a harbour at noon. " * 4}]))
    _, _, out1 = _run(prefill, decode, "w-t1", turn1)
    history = turn1 + out1[:-1]   # the last sampled token's K/V is never computed
    done = prefill.metrics["warmups_completed"]
    job = _warm(prefill, "w-t1~warm", history)
    assert job.error is None and prefill.metrics["warmups_completed"] == done + 1
    cached = (len(turn1) - 1) // BS * BS               # what turn 1's prefill registered
    assert job.prefix_hit_tokens == cached
    assert job.num_computed == len(history) // BS * BS > cached   # only full blocks are warmed
    assert alloc.num_free == alloc.num_blocks          # nothing held once it ended
    # a second warm-up of the same history finds it all cached: nothing computed
    again = _warm(prefill, "w-t1~warm2", history)
    assert again.error is None and again.prefix_hit_tokens == again.num_computed == len(history) // BS * BS
    turn2 = turn1 + out1 + tk.encode("<|im_start|>user\nAnd at midnight?<|im_end|>\n<|im_start|>assistant\n")
    _, res2, out2 = _run(prefill, decode, "w-t2", turn2)
    assert res2.prefix_hit_tokens == len(history) // BS * BS   # the answer was not computed again
    assert out2 == reference(turn2)                             # and the warmed KV is the right KV
    assert alloc.num_free == alloc.num_blocks


def test_warm_up_arguments_are_checked(pair, smollm):
    prefill, _ = pair
    with pytest.raises(InvalidRequestError):
        prefill.warm("bad", [smollm.config.vocab_size + 5] * 40)
    with pytest.raises(InvalidRequestError):
        prefill.warm("", [1] * 40)
    short = _warm(prefill, "short", [1, 2, 3])   # no full block: nothing to do
    assert short.error is None and short.num_computed == 0


def test_warm_up_needs_a_prefix_cache(smollm):
    res = _prefill_worker(smollm, num_blocks=16)
    worker = PrefillWorker(res)
    try:
        with pytest.raises(CacheDisabledError):
            worker.warm("w", list(range(100, 164)))
    finally:
        worker.close()
        res.close()
    assert not worker._thread.is_alive()


def test_warm_ups_that_need_the_prefills_room_are_dropped_and_stopping_drops_the_queue(smollm):
    res = _prefill_worker(smollm, num_blocks=16, prefix_caching=True)
    worker = PrefillWorker(res)
    alloc = res.pool.allocator
    try:
        big = _warm(worker, "big", list(range(100, 100 + 10 * BS)))   # 10 of 16 blocks: over half the pool
        assert isinstance(big.error, WarmupDropped) and worker.metrics["warmups_dropped"] == 1
        assert alloc.num_free == alloc.num_blocks and alloc.num_cached == 0
        with worker._lock:   # hold the loop off so the queue stays as submitted
            queued = [worker.warm(f"q{i}", list(range(200 + i, 200 + i + 2 * BS))) for i in range(64)]
            with pytest.raises(CapacityError):
                worker.warm("one-too-many", list(range(300, 300 + 2 * BS)))
        worker.drain(0.0)
        with pytest.raises(DrainingError):
            worker.warm("late", list(range(300, 300 + 2 * BS)))
    finally:
        worker.close()
        res.close()
    assert not worker._thread.is_alive() and not worker.sender._thread.is_alive()
    assert all(j.finished.is_set() for j in queued)
    assert any(isinstance(j.error, WarmupDropped) for j in queued)   # drain dropped what had not run
    assert worker.metrics["warmups_completed"] + worker.metrics["warmups_dropped"] == 65
    assert alloc.num_free == alloc.num_blocks


def test_a_prefill_stops_a_warm_up_pass_between_layers(smollm):
    """A long warm-up pass is running when a prefill arrives: the pass stops at the next layer,
    the prefill runs, then the warm-up runs again from where it was and its KV is right."""
    import time

    from prefill.job import JobState

    with running_pair(smollm, dict(num_blocks=128, prefix_caching=True),
                      dict(num_blocks=128, prefix_caching=True, warmup_chunk_tokens=1024)) as (prefill, decode):
        tk = smollm.tokenizer
        history = tk.encode("The lighthouse keeper wrote in his log every night. " * 100)[:60 * BS]
        warm = prefill.warm("long~warm", history)   # one pass of 960 tokens: seconds on a CPU
        while warm.state != JobState.COMPUTING:
            time.sleep(0.005)
        time.sleep(0.05)   # inside the pass
        prompt = tk.encode(tk.apply_chat_template([{"role": "user", "content": "Say hello."}]))
        _, res, _ = _run(prefill, decode, "during-warmup", prompt)
        assert len(res.first_tokens) == 1 and res.finish_reasons in ([""], ["stop"], ["length"])
        assert warm.finished.wait(120) and warm.error is None
        assert prefill.metrics["warmup_preemptions"] >= 1
        assert warm.num_computed == len(history) and prefill.metrics["warmup_tokens_computed"] >= len(history)
        # the warmed history serves a prompt that extends it, with the engine's output
        ref = build_generator(smollm, CacheConfig(num_blocks=128))
        longer = history + tk.encode(" And then?")
        _, res2, out = _run(prefill, decode, "after-warmup", longer)
        assert res2.prefix_hit_tokens == len(history)
        assert out == ref.generate([longer], PARAMS)[0].token_ids
        assert prefill.res.pool.allocator.num_free == prefill.res.pool.num_blocks


def test_warm_ups_wait_while_the_worker_lending_this_cpu_has_work(smollm, tmp_path):
    """With CPU lending, a warm-up (speculative) runs only while the worker that may borrow this
    worker's CPU waits for work: queued while it has work (and dropped once its lease passes
    then, holding nothing), run once it waits, and a warm-up pass stopped between layers when it
    gets work again, resumed from there after."""
    import os
    import time

    from prefill.job import JobState
    from worker.cpu_board import CpuBoard, CpuLending

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("lending needs 2 CPUs (this machine has 1)")
    own, lent = cpus[0], cpus[1]
    board = CpuBoard.create(tmp_path / "board", lent + 1)   # every CPU busy until its owner waits
    neighbour = CpuLending(CpuBoard(tmp_path / "board"), {lent}, {own})
    res = _prefill_worker(smollm, num_blocks=128, prefix_caching=True, warmup_chunk_tokens=1024,
                          prefill_timeout_s=2.0, cpu_board=str(tmp_path / "board"), borrow_cpus=str(lent))
    worker = PrefillWorker(res)
    alloc = res.pool.allocator
    history = smollm.tokenizer.encode("The lighthouse keeper wrote in his log every night. " * 100)[:60 * BS]
    try:
        neighbour.busy(True)
        late = worker.warm("deferred", history[:4 * BS])
        assert late.finished.wait(30) and isinstance(late.error, WarmupDropped)   # its lease passed
        assert "deferred" in str(late.error) and late.num_computed == 0
        assert worker.metrics["warmups_dropped"] == 1 and alloc.num_free == alloc.num_blocks
        warm = worker.warm("long~warm", history)   # one pass of 960 tokens: seconds on a CPU
        time.sleep(0.3)
        assert warm.state == JobState.QUEUED and worker.metrics["warmup_tokens_computed"] == 0
        neighbour.busy(False)                       # the neighbour waits: the warm-up runs
        while warm.state != JobState.COMPUTING:
            time.sleep(0.005)
        time.sleep(0.05)
        neighbour.busy(True)                        # ... and has work again mid-pass
        deadline = time.monotonic() + 30
        while worker.metrics["warmup_preemptions"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.metrics["warmup_preemptions"] >= 1 and not warm.finished.is_set()
        neighbour.busy(False)
        assert warm.finished.wait(120) and warm.error is None and warm.num_computed == len(history)
        assert worker.metrics["warmups_completed"] == 1 and alloc.num_free == alloc.num_blocks
    finally:
        worker.close()
        res.close()
        neighbour.close()
        board.close()
    assert not worker._thread.is_alive() and not worker.sender._thread.is_alive()
