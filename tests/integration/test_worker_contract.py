"""The worker services' wire contract under load and bad arguments, on real worker processes
over real gRPC (tcp data plane), the test playing the router:

- open streams pin no thread: control calls are answered at once with 100 streams open;
- Prefill and Decode validate before touching state (INVALID_ARGUMENT), and a bad request
  never fails its batch-mates;
- the block quarantine: blocks of a request aborted without ``writer_stopped`` come back when the
  writer's connection drops (the one that wrote, or the one named at Reserve that wrote nothing
  yet), or after ``quarantine_s``.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine.config import CacheConfig
from engine.loader import build_generator
from engine.sampling import SamplingParams
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from tests.integration.worker_pair import run_request as disaggregated
from tests.integration.worker_pair import start_worker, stop, wait_ready
from worker.convert import sampling_to_proto

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NUM_BLOCKS = 256
QUARANTINE_S = 6.0
FLAGS = ("--transfer-engine", "tcp", "--prefill-timeout-s", "4", "--quarantine-s", str(QUARANTINE_S),
         "--max-num-seqs", "32")


@pytest.fixture(scope="module")
def workers():
    dproc, daddr = start_worker("decode", *FLAGS)
    procs = {"decode": dproc}
    try:
        decode, dch = wait_ready(daddr, pb_grpc.DecodeStub, dproc)
        state = {"decode": decode, "procs": procs, "channels": [dch]}

        def new_prefill(tag: str):
            pproc, paddr = start_worker("prefill", *FLAGS)
            procs[tag] = pproc
            prefill, pch = wait_ready(paddr, pb_grpc.PrefillStub, pproc)
            state["channels"].append(pch)
            pep = prefill.Describe(pb.DescribeRequest())
            dep = decode.Connect(pb.ConnectRequest(peer_worker_id=tag, peer_endpoint=pep)).endpoint
            prefill.Connect(pb.ConnectRequest(peer_worker_id="d", peer_endpoint=dep))
            return prefill

        state["new_prefill"] = new_prefill
        state["prefill"] = new_prefill("p")
        yield state
    finally:
        for ch in state.get("channels", []):
            ch.close()
        for proc in procs.values():
            if proc.poll() is None:
                stop(proc)


def free_blocks(decode) -> int:
    return decode.Stats(pb.StatsRequest(), timeout=5).load.free_blocks


def wait_free(decode, want: int, within_s: float) -> float:
    t0 = time.monotonic()
    while free_blocks(decode) != want:
        assert time.monotonic() - t0 < within_s, f"free blocks {free_blocks(decode)} != {want} after {within_s}s"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def prompt_and_reference(smollm):
    tk = smollm.tokenizer
    prompt = tk.encode(tk.apply_chat_template([{"role": "user", "content": "Name three rivers."}]))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [ref] = build_generator(smollm, CacheConfig(num_blocks=64)).generate([prompt], params)
    return prompt, params, ref.token_ids


def test_control_calls_are_answered_with_100_streams_open(workers, smollm):
    """Each stream used to pin one of 64 gRPC threads: past 64, Stats/Abort/Reserve queued."""
    decode = workers["decode"]
    prompt = smollm.tokenizer.encode("Count slowly: one, two,")
    sp = sampling_to_proto(SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    streams = [decode.ServeColocated(pb.ColocatedRequest(request_id=f"open-{i}", prompt_token_ids=prompt, sampling=sp))
               for i in range(100)]
    try:
        deadline = time.monotonic() + 60   # every call arrived: 32 decoding, 68 queued
        while decode.Stats(pb.StatsRequest(), timeout=3).load.running < 100:
            assert time.monotonic() < deadline, "the streams did not all arrive"
            time.sleep(0.2)
        rtts = []
        for i in range(10):
            t0 = time.monotonic()
            decode.Stats(pb.StatsRequest(), timeout=3)
            assert not decode.Abort(pb.AbortRequest(request_id=f"nobody-{i}"), timeout=3).found
            r = decode.Reserve(pb.ReserveRequest(request_id=f"res-{i}", num_prompt_tokens=20, max_tokens=4), timeout=3)
            assert decode.Abort(pb.AbortRequest(request_id=f"res-{i}", writer_stopped=True), timeout=3).found
            rtts.append(time.monotonic() - t0)
            assert len(r.block_ids) == 2
        print(f"\ncontrol round trips with 100 open streams: max {max(rtts) * 1000:.0f} ms")
        assert decode.Stats(pb.StatsRequest(), timeout=3).load.running == 100
    finally:
        for s in streams:
            s.cancel()
    wait_free(decode, NUM_BLOCKS, 30)


def test_bad_prefill_arguments_are_refused_and_batch_mates_finish(workers, prompt_and_reference):
    prefill, decode = workers["prefill"], workers["decode"]
    prompt, params, want = prompt_and_reference
    sp = sampling_to_proto(params)
    r = decode.Reserve(pb.ReserveRequest(request_id="victim", num_prompt_tokens=len(prompt), max_tokens=24))
    ids = list(r.block_ids)
    bad = {"duplicate block ids": dict(block_ids=[ids[0]] * len(ids)),
           "block id outside the pool": dict(block_ids=ids[:-1] + [NUM_BLOCKS + 7]),
           "too few blocks": dict(block_ids=ids[:-1]),
           "slot out of range": dict(block_ids=ids, slot=1 << 24),
           "generation out of range": dict(block_ids=ids, generation=256),
           "token outside the vocabulary": dict(block_ids=ids, token_ids=prompt[:-1] + [10 ** 9])}
    results: dict = {}

    def good():
        results["good"] = disaggregated(prefill, decode, "good", prompt, params)

    t = threading.Thread(target=good, name="good-request")
    t.start()
    for name, fields in bad.items():
        req = dict(request_id=f"bad-{len(results)}-{name}", token_ids=prompt, sampling=sp, decode_worker_id="d",
                   slot=r.slot, generation=r.generation)
        req.update(fields)
        with pytest.raises(grpc.RpcError) as err:
            prefill.Prefill(pb.PrefillRequest(**req), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
        results[name] = err.value.details()
    t.join(120)
    assert results["good"] == want
    assert decode.Abort(pb.AbortRequest(request_id="victim", writer_stopped=True)).found
    wait_free(decode, NUM_BLOCKS, 10)
    stats = prefill.Stats(pb.StatsRequest())
    assert stats.counters["prefills_failed"] == 0 and stats.load.free_blocks == stats.load.total_blocks


def test_bad_decode_arguments_leave_the_reservation_and_the_batch_alone(workers, prompt_and_reference):
    prefill, decode = workers["prefill"], workers["decode"]
    prompt, params, want = prompt_and_reference
    sp = sampling_to_proto(params)
    # a running batch-mate
    mate: dict = {}
    t = threading.Thread(target=lambda: mate.update(tokens=disaggregated(prefill, decode, "mate", prompt, params)),
                         name="batch-mate")
    t.start()
    r = decode.Reserve(pb.ReserveRequest(request_id="dec", num_prompt_tokens=len(prompt), max_tokens=24))
    p = prefill.Prefill(pb.PrefillRequest(request_id="dec", token_ids=prompt, sampling=sp, decode_worker_id="d",
                                          block_ids=r.block_ids, slot=r.slot, generation=r.generation))
    good = dict(request_id="dec", first_tokens=p.first_tokens, num_writes=p.num_writes, sampling=sp,
                prompt_token_ids=prompt)
    for name, fields in {"first token outside the vocabulary": dict(first_tokens=[10 ** 6]),
                         "prompt of another length": dict(prompt_token_ids=prompt + prompt[:3]),
                         "prompt token outside the vocabulary": dict(prompt_token_ids=prompt[:-1] + [10 ** 7]),
                         "absurd write count": dict(num_writes=1 << 30)}.items():
        req = dict(good, **fields)
        with pytest.raises(grpc.RpcError) as err:
            list(decode.Decode(pb.DecodeRequest(**req), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
    # the reservation is still there, untouched: the right Decode now completes exactly
    tokens = list(p.first_tokens) + [t for c in decode.Decode(pb.DecodeRequest(**good)) for t in c.token_ids]
    assert tokens == want
    t.join(120)
    assert mate["tokens"] == want
    wait_free(decode, NUM_BLOCKS, 10)


def test_quarantined_blocks_return_after_quarantine_s(workers):
    decode = workers["decode"]
    r = decode.Reserve(pb.ReserveRequest(request_id="q1", num_prompt_tokens=100, max_tokens=4))
    assert decode.Abort(pb.AbortRequest(request_id="q1")).found   # writer not known to have stopped
    assert free_blocks(decode) == NUM_BLOCKS - len(r.block_ids)
    waited = wait_free(decode, NUM_BLOCKS, QUARANTINE_S + 5)
    assert waited > QUARANTINE_S - 2
    assert decode.Stats(pb.StatsRequest()).counters["blocks_quarantined"] >= len(r.block_ids)


def test_quarantined_blocks_return_when_the_writer_is_lost(workers, smollm):
    decode = workers["decode"]
    prefill = workers["new_prefill"]("p-doomed")
    prompt = smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    sp = sampling_to_proto(SamplingParams(max_tokens=4, temperature=0))
    r = decode.Reserve(pb.ReserveRequest(request_id="q2", num_prompt_tokens=len(prompt), max_tokens=4))
    prefill.Prefill(pb.PrefillRequest(request_id="q2", token_ids=prompt, sampling=sp, decode_worker_id="d",
                                      block_ids=r.block_ids, slot=r.slot, generation=r.generation))
    assert decode.Abort(pb.AbortRequest(request_id="q2")).found    # writer_stopped not claimed
    # named as the writer at Reserve, it has written nothing into these: it still may
    named = decode.Reserve(pb.ReserveRequest(request_id="q3", num_prompt_tokens=100, max_tokens=4,
                                             writer_worker_id="p-doomed"))
    assert decode.Abort(pb.AbortRequest(request_id="q3")).found
    assert free_blocks(decode) == NUM_BLOCKS - len(r.block_ids) - len(named.block_ids)
    workers["procs"]["p-doomed"].kill()                             # its tcp connections drop
    assert wait_free(decode, NUM_BLOCKS, 5) < QUARANTINE_S - 1     # long before the quarantine ends
