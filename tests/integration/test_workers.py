"""Prefill and decode workers as real processes, driven over real gRPC the way the router does.

The test plays the router: Describe/Connect brokering, Reserve, Prefill, Decode stream, Abort,
Stats. Greedy output must equal the single-process engine's; every block returns to both pools.
"""

from __future__ import annotations

import time

import grpc
import pytest

from engine.config import CacheConfig
from engine.loader import build_generator
from engine.sampling import SamplingParams
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.auth import client_interceptor
from worker.convert import sampling_to_proto
from tests.integration.worker_pair import broker, run_request, start_worker, stop, wait_ready

pytestmark = pytest.mark.integration
ADDRESSES: dict[str, str] = {}


@pytest.fixture(scope="module", params=["auto", "tcp"])
def pair(request):
    engine = request.param
    dproc, daddr = start_worker("decode", "--transfer-engine", engine)
    pproc, paddr = start_worker("prefill", "--transfer-engine", engine)
    try:
        ADDRESSES.update(prefill=paddr, decode=daddr)
        decode, dch = wait_ready(daddr, pb_grpc.DecodeStub, dproc)
        prefill, pch = wait_ready(paddr, pb_grpc.PrefillStub, pproc)
        broker(prefill, decode)
        yield prefill, decode, engine
        dch.close()
        pch.close()
    finally:
        codes = [stop(pproc), stop(dproc)]
    assert codes == [0, 0], "workers must exit 0 on SIGTERM"


def test_disaggregated_greedy_equals_single_process(pair, smollm):
    prefill, decode, engine = pair
    tk = smollm.tokenizer
    prompts = [tk.encode(tk.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is the capital of France?", "Write a limerick about a cat. " * 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gen = build_generator(smollm, CacheConfig(num_blocks=256))
    expected = [r.token_ids for r in gen.generate(prompts, params)]
    for i, prompt in enumerate(prompts):
        assert run_request(prefill, decode, f"{engine}-{i}", prompt, params) == expected[i]
    d = decode.Stats(pb.StatsRequest())
    p = prefill.Stats(pb.StatsRequest())
    assert d.load.free_blocks == d.load.total_blocks == 256
    assert p.load.free_blocks == p.load.total_blocks
    assert d.counters["transfers_completed"] >= 2 and d.counters["stale_immediates_dropped"] == 0


def test_the_prefill_worker_says_whether_each_first_token_ends_its_choice(pair, smollm):
    """The first token's finish reason is the prefill worker's (the router no longer derives it):
    "length" at max_tokens 1, "stop" for a stop token, "" otherwise, one per choice; the decode
    worker then ends such a choice at once."""
    prefill, decode, engine = pair
    tk = smollm.tokenizer
    prompt = tk.encode(tk.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))

    def first(rid, params):
        r = decode.Reserve(pb.ReserveRequest(request_id=rid, num_prompt_tokens=len(prompt), max_tokens=params.max_tokens))
        p = prefill.Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=sampling_to_proto(params),
                                              decode_worker_id="d", block_ids=r.block_ids, slot=r.slot,
                                              generation=r.generation))
        decode.Abort(pb.AbortRequest(request_id=rid, writer_stopped=True))
        return list(p.first_tokens), list(p.finish_reasons)

    [token], reasons = first(f"{engine}-f0", SamplingParams(max_tokens=4, temperature=0))
    assert reasons == [""]
    assert first(f"{engine}-f1", SamplingParams(max_tokens=1, temperature=0)) == ([token], ["length"])
    assert first(f"{engine}-f2", SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[token])) == ([token], ["stop"])
    tokens, reasons = first(f"{engine}-f3", SamplingParams(max_tokens=1, temperature=0.8, seed=3, n=3))
    assert len(tokens) == 3 and reasons == ["length"] * 3
    assert decode.Stats(pb.StatsRequest()).load.free_blocks == 256


def test_reserve_refuses_when_full_and_abort_returns_blocks(pair):
    prefill, decode, engine = pair
    with pytest.raises(grpc.RpcError) as err:
        decode.Reserve(pb.ReserveRequest(request_id="huge", num_prompt_tokens=256 * 16 + 1, max_tokens=1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    r = decode.Reserve(pb.ReserveRequest(request_id="ab", num_prompt_tokens=100, max_tokens=5))
    assert len(r.block_ids) == 7
    assert decode.Stats(pb.StatsRequest()).load.free_blocks == 256 - 7
    assert decode.Abort(pb.AbortRequest(request_id="ab", writer_stopped=True)).found
    assert decode.Stats(pb.StatsRequest()).load.free_blocks == 256
    assert not decode.Abort(pb.AbortRequest(request_id="ab")).found


def test_worker_refuses_calls_without_the_cluster_token(pair):
    for address in ADDRESSES.values():
        for secret in (None, b"not-the-cluster-secret-0123"):
            channel = grpc.insecure_channel(address)
            if secret is not None:
                channel = grpc.intercept_channel(channel, client_interceptor(secret))
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DecodeStub(channel).Stats(pb.StatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cancelled_decode_stream_frees_blocks(pair, smollm):
    prefill, decode, engine = pair
    prompt = smollm.tokenizer.encode("Count from one to one hundred: one, two,")
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    sp = sampling_to_proto(params)
    r = decode.Reserve(pb.ReserveRequest(request_id="cx", num_prompt_tokens=len(prompt), max_tokens=200))
    p = prefill.Prefill(pb.PrefillRequest(request_id="cx", token_ids=prompt, sampling=sp, decode_worker_id="d",
                                          block_ids=r.block_ids, slot=r.slot, generation=r.generation))
    stream = decode.Decode(pb.DecodeRequest(request_id="cx", first_tokens=p.first_tokens, num_writes=p.num_writes,
                                            sampling=sp, prompt_token_ids=prompt))
    next(stream)
    next(stream)
    stream.cancel()
    end = time.monotonic() + 10
    while decode.Stats(pb.StatsRequest()).load.free_blocks != 256 and time.monotonic() < end:
        time.sleep(0.1)
    assert decode.Stats(pb.StatsRequest()).load.free_blocks == 256


def test_colocated_generate_equals_single_process(pair, smollm):
    prefill, decode, engine = pair
    tk = smollm.tokenizer
    prompt = tk.encode(tk.apply_chat_template([{"role": "user", "content": "Name a large animal."}]))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    [expected] = build_generator(smollm, CacheConfig(num_blocks=64)).generate([prompt], params)
    tokens = []
    for chunk in decode.ServeColocated(pb.ColocatedRequest(request_id=f"co-{engine}", prompt_token_ids=prompt,
                                                    sampling=sampling_to_proto(params))):
        tokens += chunk.token_ids
        if chunk.finish_reason:
            assert chunk.finish_reason == "length"
    assert tokens == expected.token_ids
    assert decode.Stats(pb.StatsRequest()).load.free_blocks == 256
