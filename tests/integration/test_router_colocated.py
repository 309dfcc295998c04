"""The orchestrator's colocated path over real gRPC against scripted decode workers: retry of a
ServeColocated stream failing before or after its first token, stop strings and client disconnects
cancelling the stream and aborting the request on its worker."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc
import pytest

import rpc
from router.config import RouterConfig
from router.errors import UpstreamError
from router.membership import Membership
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.policy import make_policy
from router.request import GenerationRequest
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg

pytestmark = pytest.mark.integration


class ScriptedDecode(pbg.DecodeServicer):
    """``ServeColocated`` streams ``tokens`` one per chunk; ``fail_after``: abort the stream with
    UNAVAILABLE after that many tokens (None: finish with "length")."""

    def __init__(self, tokens: list[int], fail_after: int | None = None, delay_s: float = 0.0,
                 last_reason: str = "length"):
        self.tokens, self.fail_after, self.delay_s, self.last_reason = tokens, fail_after, delay_s, last_reason
        self.calls: list[pb.ColocatedRequest] = []
        self.aborts: list[pb.AbortRequest] = []
        self.cancelled: list[str] = []

    async def ServeColocated(self, request, context):
        self.calls.append(request)
        n = min(len(self.tokens), request.sampling.max_tokens)
        try:
            for i, t in enumerate(self.tokens[:n]):
                if self.fail_after is not None and i == self.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
                await asyncio.sleep(self.delay_s)
                yield pb.TokenChunk(token_ids=[t], finish_reason=self.last_reason if i == n - 1 else "")
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def Abort(self, request, context):
        self.aborts.append(request)
        return pb.AbortResponse(found=True)


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizer import Tokenizer
    from engine.modelfile import resolve_model_path

    return Tokenizer.from_file(resolve_model_path(None))


async def _cluster(servicers: dict[str, ScriptedDecode], tokenizer, max_attempts: int = 3):
    """Servers for ``servicers`` (worker id -> servicer) and an orchestrator routing to them."""
    membership = Membership(standalone_decode=True)
    servers = []
    for wid, servicer in servicers.items():
        server = grpc.aio.server()
        pbg.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        membership.register(pb.WorkerInfo(
            worker_id=wid, role=pb.DECODE, grpc_address=f"127.0.0.1:{port}", host_id="h",
            protocol_version=rpc.PROTOCOL_VERSION, compat_hash="x", num_blocks=64, block_size=16,
            transfer_engine="tcp"))
    config = RouterConfig(serving_mode="colocated", max_attempts=max_attempts, rpc_timeout_s=2.0)
    metrics = RouterMetrics()
    orch = Orchestrator(config, membership, tokenizer, make_policy("round_robin"), metrics)
    return orch, servers, metrics


async def _shutdown(orch, servers):
    await orch.close()
    for s in servers:
        await s.stop(None)


def _request(tokenizer, max_tokens: int, stop=()) -> GenerationRequest:
    return GenerationRequest("cmpl-1", tuple(tokenizer.encode("Hi there")), max_tokens,
                             temperature=0.0, stop=tuple(stop), ignore_eos=True)


async def _collect(orch, req):
    deltas = []
    async with aclosing(orch.generate(req)) as it:
        async for d in it:
            deltas.append(d)
    return deltas


def test_the_workers_finish_reason_is_the_requests_and_only_stop_strings_are_the_routers(tokenizer):
    """The worker decides token-level stops: a stop token it reports ("stop") ends the choice
    with its text hidden, and a stop id it does not report as one (ignore_eos) is ordinary text;
    the router counts no max_tokens of its own (the worker's "length" ends the choice) and stops
    on stop strings alone."""
    eos = min(tokenizer.stop_token_ids)
    words = tokenizer.encode(" one two three")

    async def run(tokens, reason, max_tokens, stop=()):
        orch, servers, _ = await _cluster({"d0": ScriptedDecode(tokens, last_reason=reason)}, tokenizer)
        req = GenerationRequest("cmpl-1", tuple(tokenizer.encode("Hi there")), max_tokens, temperature=0.0,
                                stop=tuple(stop))   # EOS is a stop token of this request
        try:
            return await _collect(orch, req)
        finally:
            await _shutdown(orch, servers)

    stopped = asyncio.run(run(words + [eos], "stop", 16))
    assert stopped[-1].finish_reason == "stop" and "".join(d.text for d in stopped) == " one two three"
    assert [t for d in stopped for t in d.token_ids] == words + [eos]
    plain = asyncio.run(run([eos] + words, "length", 16))   # the worker did not call that EOS a stop
    assert plain[-1].finish_reason == "length" and [t for d in plain for t in d.token_ids] == [eos] + words
    assert [d.finish_reason for d in plain[:-1]] == [None] * (len(plain) - 1)
    cut = asyncio.run(run(words, "length", 16, stop=(" two",)))
    assert cut[-1].finish_reason == "stop" and "".join(d.text for d in cut) == " one"


def test_failure_before_the_first_token_is_retried_elsewhere(tokenizer):
    tokens = tokenizer.encode(" one two three four")

    async def main():
        bad, good = ScriptedDecode(tokens, fail_after=0), ScriptedDecode(tokens)
        orch, servers, metrics = await _cluster({"d0": bad, "d1": good}, tokenizer)
        try:
            deltas = await _collect(orch, _request(tokenizer, len(tokens)))
        finally:
            await _shutdown(orch, servers)
        return bad, good, metrics, deltas

    bad, good, metrics, deltas = asyncio.run(main())
    assert [t for d in deltas for t in d.token_ids] == tokens
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == len(tokens)
    assert len(bad.calls) == 1 and [c.request_id for c in good.calls] == ["cmpl-1~2"]
    assert [a.request_id for a in bad.aborts] == ["cmpl-1"] and bad.aborts[0].writer_stopped
    assert metrics.retries._value.get() == 1
    assert metrics.requests_by_path.labels("colocated")._value.get() == 1


def test_failure_mid_stream_resumes_with_the_generated_tokens(tokenizer):
    tokens = tokenizer.encode(" one two three four five")

    async def main():
        flaky, good = ScriptedDecode(tokens, fail_after=2), ScriptedDecode(tokens[2:])
        orch, servers, _ = await _cluster({"d0": flaky, "d1": good}, tokenizer)
        try:
            deltas = await _collect(orch, _request(tokenizer, len(tokens)))
        finally:
            await _shutdown(orch, servers)
        return good, deltas

    good, deltas = asyncio.run(main())
    assert [t for d in deltas for t in d.token_ids] == tokens
    (resumed,) = good.calls
    prompt = tokenizer.encode("Hi there")
    assert list(resumed.prompt_token_ids) == prompt + tokens[:2]
    assert resumed.sampling.max_tokens == len(tokens) - 2


def test_every_attempt_failing_is_an_upstream_error(tokenizer):
    async def main():
        orch, servers, _ = await _cluster({"d0": ScriptedDecode([1, 2], fail_after=0)}, tokenizer,
                                          max_attempts=2)
        try:
            with pytest.raises(UpstreamError):
                await _collect(orch, _request(tokenizer, 2))
        finally:
            await _shutdown(orch, servers)

    asyncio.run(main())


def test_stop_string_cancels_the_stream_and_aborts(tokenizer):
    tokens = tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta")

    async def main():
        d0 = ScriptedDecode(tokens, delay_s=0.05)
        orch, servers, _ = await _cluster({"d0": d0}, tokenizer)
        try:
            deltas = await _collect(orch, _request(tokenizer, len(tokens), stop=["gamma"]))
        finally:
            await _shutdown(orch, servers)
        return d0, deltas

    d0, deltas = asyncio.run(main())
    text = "".join(d.text for d in deltas)
    assert text == " alpha beta " and deltas[-1].finish_reason == "stop"
    assert [a.request_id for a in d0.aborts] == ["cmpl-1"]


def test_client_disconnect_cancels_and_aborts(tokenizer):
    tokens = tokenizer.encode(" a b c d e f g h i j k l")

    async def main():
        d0 = ScriptedDecode(tokens, delay_s=0.05)
        orch, servers, _ = await _cluster({"d0": d0}, tokenizer)
        try:
            it = orch.generate(_request(tokenizer, len(tokens)))
            await it.__anext__()
            await it.aclose()  # the client went away after its first token
            for _ in range(50):
                if d0.cancelled:
                    break
                await asyncio.sleep(0.02)
        finally:
            await _shutdown(orch, servers)
        return d0

    d0 = asyncio.run(main())
    assert d0.cancelled == ["cmpl-1"]
    assert [a.request_id for a in d0.aborts] == ["cmpl-1"] and d0.aborts[0].writer_stopped
