"""Typed clients of the worker services: the router's side of the wire contract.

Every gRPC status a worker answers (the table at the top of ``rpc/pdserve.proto``) becomes one of
three exceptions here, so the orchestrator handles router exceptions only:

- `WorkerRejected` (INVALID_ARGUMENT): the request itself is wrong; never retried (HTTP 400).
- `WorkerFull` (RESOURCE_EXHAUSTED): no room on that worker now; try another or wait.
- `WorkerFailed` (anything else, a stalled stream included): this placement failed; retry the
  request on another pair if attempts remain.

All calls carry the cluster token (``metadata``) and a deadline. Used from one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg


class WorkerCallError(Exception):
    """A call to worker ``worker_id`` failed; ``code`` is the gRPC status name."""

    def __init__(self, worker_id: str, what: str, code: str, details: str):
        super().__init__(f"{what} on {worker_id}: {code} {details}".rstrip())
        self.worker_id, self.code, self.details = worker_id, code, details


class WorkerRejected(WorkerCallError):
    """INVALID_ARGUMENT: the request is wrong (the client gets a 400; no retry)."""


class WorkerFull(WorkerCallError):
    """RESOURCE_EXHAUSTED: the worker has no room for the request now."""


class WorkerFailed(WorkerCallError):
    """Any other failure of the call (retry the request elsewhere)."""


def _translate(exc: grpc.aio.AioRpcError, worker_id: str, what: str) -> WorkerCallError:
    code = exc.code()
    kind = {grpc.StatusCode.INVALID_ARGUMENT: WorkerRejected,
            grpc.StatusCode.RESOURCE_EXHAUSTED: WorkerFull}.get(code, WorkerFailed)
    return kind(worker_id, what, code.name, exc.details() or "")


@dataclass(frozen=True)
class DecodeLease:
    """What a decode worker's ``Reserve`` answered: the blocks and transfer slot it reserved for
    the request, until ``expires_at`` (router-monotonic seconds when the lease ends, computed
    from ``lease_s`` when the answer arrived, so it is never later than the worker's own
    expiry)."""

    block_ids: tuple[int, ...]
    slot: int
    generation: int
    expires_at: float
    num_held_blocks: int = 0   # block_ids[:num_held_blocks] already hold the prompt's first blocks

    def write_deadline_s(self, margin_s: float) -> float:
        """Seconds from now the prefill may still post writes (>= 0.001)."""
        return max(0.001, self.expires_at - time.monotonic() - margin_s)


class TokenStream:
    """A ``Decode`` or ``ServeColocated`` stream: `read` the chunks, `cancel` when done early."""

    def __init__(self, call, worker_id: str, what: str):
        self._call, self._worker_id, self._what = call, worker_id, what

    async def read(self, stall_s: float) -> pb.TokenChunk:
        """The next chunk. Raises `WorkerRejected`, or `WorkerFailed` when the stream fails,
        ends without a finish reason, or sends nothing for ``stall_s`` seconds."""
        try:
            chunk = await asyncio.wait_for(self._call.read(), stall_s)
        except asyncio.TimeoutError:
            raise WorkerFailed(self._worker_id, self._what, "STALLED",
                               f"no token for {stall_s:g}s") from None
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, self._worker_id, self._what) from exc
        if chunk is grpc.aio.EOF:
            raise WorkerFailed(self._worker_id, self._what, "EOF", "stream ended without a finish reason")
        return chunk

    def cancel(self) -> None:
        if not self._call.done():
            self._call.cancel()


class WorkerClient:
    """Calls to one worker over ``channel``; ``timeout_s`` bounds the small control calls."""

    def __init__(self, worker_id: str, channel: grpc.aio.Channel, metadata: tuple, timeout_s: float):
        self.worker_id = worker_id
        self._md, self._timeout = metadata, timeout_s
        self._prefill = pbg.PrefillStub(channel)
        self._decode = pbg.DecodeStub(channel)

    async def _unary(self, what: str, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self._timeout, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, self.worker_id, what) from exc

    # -- decode --------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      prompt: Sequence[int] = (), writer: str = "") -> DecodeLease:
        """``prompt``: given to a decode worker with a prefix cache (it holds the cached blocks);
        ``writer``: the prefill worker id that will write the KV (ReserveRequest.writer_worker_id).
        Raises `WorkerFailed` on a reply whose ``num_held_blocks`` exceeds its blocks."""
        resp = await self._unary("Reserve", self._decode.Reserve, pb.ReserveRequest(
            request_id=request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
            prompt_token_ids=prompt, writer_worker_id=writer))
        if resp.num_held_blocks > len(resp.block_ids):
            raise WorkerFailed(self.worker_id, "Reserve", "BAD_REPLY",
                               f"{resp.num_held_blocks} held blocks of {len(resp.block_ids)}")
        return DecodeLease(tuple(resp.block_ids), resp.slot, resp.generation, time.monotonic() + resp.lease_s,
                           resp.num_held_blocks)

    def decode(self, request_id: str, first_tokens: Sequence[int], num_writes: int, sampling: pb.SamplingParams,
               prompt: Sequence[int], timeout_s: float) -> TokenStream:
        """``first_tokens``: every choice's first token (``sampling.n`` of them)."""
        call = self._decode.Decode(pb.DecodeRequest(
            request_id=request_id, first_tokens=first_tokens, num_writes=num_writes, sampling=sampling,
            prompt_token_ids=prompt), timeout=timeout_s, metadata=self._md)
        return TokenStream(call, self.worker_id, "Decode")

    def serve_colocated(self, request_id: str, prompt: Sequence[int], sampling: pb.SamplingParams,
                        timeout_s: float) -> TokenStream:
        call = self._decode.ServeColocated(pb.ColocatedRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling), timeout=timeout_s,
            metadata=self._md)
        return TokenStream(call, self.worker_id, "ServeColocated")

    async def abort_decode(self, request_id: str, writer_stopped: bool) -> bool:
        resp = await self._unary("Abort", self._decode.Abort,
                                 pb.AbortRequest(request_id=request_id, writer_stopped=writer_stopped))
        return resp.found

    # -- prefill -------------------------------------------------------------------------------
    async def prefill(self, request: pb.PrefillRequest, timeout_s: float) -> pb.PrefillResponse:
        return await self._unary("Prefill", self._prefill.Prefill, request, timeout_s)

    async def warm(self, request_id: str, token_ids: Sequence[int], timeout_s: float) -> pb.WarmResponse:
        """``Prefill.Warm``: answers once the warm-up ran or was dropped."""
        return await self._unary("Warm", self._prefill.Warm,
                                 pb.WarmRequest(request_id=request_id, token_ids=token_ids), timeout_s)

    async def abort_prefill(self, request_id: str) -> bool:
        """Returns once the worker's posted writes for the request completed (its acknowledgement)."""
        resp = await self._unary("Abort", self._prefill.Abort, pb.AbortRequest(request_id=request_id))
        return resp.found

    # -- both ----------------------------------------------------------------------------------
    async def stats(self, role: str) -> pb.StatsResponse:
        method = self._prefill.Stats if role == "prefill" else self._decode.Stats
        return await self._unary("Stats", method, pb.StatsRequest())
