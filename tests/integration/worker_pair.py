"""A prefill and a decode worker as real processes, and the router's calls on them over gRPC:
what the worker tests and the model-family tests share."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc

from deploy.launcher import free_port
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.auth import DEV_SECRET, client_interceptor
from worker.convert import sampling_to_proto


def start_worker(role: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", role, "--listen", f"127.0.0.1:{port}", "--router", f"127.0.0.1:{free_port()}",
            "--worker-id", f"{role}-test-{port}", "--num-blocks", "256", *flags]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    return proc, f"127.0.0.1:{port}"


def wait_ready(address: str, stub_cls, proc: subprocess.Popen, timeout: float = 180.0):
    channel = grpc.intercept_channel(grpc.insecure_channel(address), client_interceptor(DEV_SECRET))
    stub = stub_cls(channel)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            stub.Stats(pb.StatsRequest(), timeout=1.0)
            return stub, channel
        except grpc.RpcError:
            time.sleep(0.3)
    raise TimeoutError(f"worker at {address} not ready")


def stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def broker(prefill, decode) -> None:
    """Connect the pair's data plane exactly as the router does (Describe, then Connect both ways)."""
    pep = prefill.Describe(pb.DescribeRequest())
    dep = decode.Connect(pb.ConnectRequest(peer_worker_id="p", peer_endpoint=pep)).endpoint
    prefill.Connect(pb.ConnectRequest(peer_worker_id="d", peer_endpoint=dep))


def run_request(prefill, decode, rid: str, prompt: list[int], params) -> list[int]:
    """One request through the pair (Reserve, Prefill, Decode stream): its tokens."""
    r = decode.Reserve(pb.ReserveRequest(request_id=rid, num_prompt_tokens=len(prompt), max_tokens=params.max_tokens))
    sp = sampling_to_proto(params)
    p = prefill.Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=sp, decode_worker_id="d",
                                          block_ids=r.block_ids, slot=r.slot, generation=r.generation))
    tokens = list(p.first_tokens)
    for chunk in decode.Decode(pb.DecodeRequest(request_id=rid, first_tokens=p.first_tokens, num_writes=p.num_writes,
                                                sampling=sp, prompt_token_ids=prompt)):
        tokens += chunk.token_ids
        if chunk.finish_reason:
            break
    return tokens


def serve_one(flags: tuple[str, ...], rid: str, prompt: list[int], params) -> list[int]:
    """Start a decode and a prefill worker with ``flags``, broker them, run one request and stop
    both: its tokens. Asserts every block back in both pools and both workers exiting 0."""
    dproc, daddr = start_worker("decode", *flags)
    pproc, paddr = start_worker("prefill", *flags)
    try:
        decode, dch = wait_ready(daddr, pb_grpc.DecodeStub, dproc)
        prefill, pch = wait_ready(paddr, pb_grpc.PrefillStub, pproc)
        broker(prefill, decode)
        tokens = run_request(prefill, decode, rid, prompt, params)
        d, p = decode.Stats(pb.StatsRequest()), prefill.Stats(pb.StatsRequest())
        assert d.load.free_blocks == d.load.total_blocks and p.load.free_blocks == p.load.total_blocks
        dch.close()
        pch.close()
    finally:
        codes = [stop(pproc), stop(dproc)]
    assert codes == [0, 0]
    return tokens
