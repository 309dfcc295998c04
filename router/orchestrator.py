"""One request end to end, over grpc.aio (ARCHITECTURE.md, "One request, end to end").

Lifecycle of a request (`Orchestrator.generate`, an async iterator of `Delta`):

    reserve   pick a decode worker (policy), ``Reserve`` -> blocks, slot, generation.
              RESOURCE_EXHAUSTED: try the next worker; all full: wait for capacity until
              ``reserve_timeout_s`` (-> `CapacityTimeout`). No connected pair: `NoWorkers`.
    prefill   pick a prefill worker linked to that decode worker, ``Prefill`` -> first token,
              num_writes. The first token is yielded (TTFT).
    decode    ``Decode`` stream -> tokens, detokenized here; a stop string ends the request
              (the stream is cancelled and the decode worker told to Abort).
    release   on any failure, cancellation (client gone) or router-side stop, the workers
              holding the request are told to Abort, in the order the block-reuse rule needs:
              the prefill worker first (its Abort returns once its posted writes completed),
              then the decode worker with ``writer_stopped`` true only when the writer is known
              to have stopped (Prefill answered, or acknowledged the Abort).

Colocated path (`router.serving` decides per request): ``Generate`` on one decode worker, which
prefills and decodes on its own pool (no reserve, no prefill worker); its stream is read like
``Decode``'s (first chunk = first token), and release is an ``Abort`` of the decode worker alone
(no remote writer: ``writer_stopped`` true).

A worker failing before any token reached the client, or dying mid-stream, costs one attempt
(`RouterConfig.max_attempts`); the next attempt re-prefills prompt + tokens generated so far on a
new pair (request id suffixed ``~N``). Bad input found by a worker (INVALID_ARGUMENT) is not
retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from router.config import RouterConfig
from router.errors import CapacityTimeout, InvalidRequest, NoWorkers, UpstreamError
from router.membership import Member, Membership
from router.metrics import RouterMetrics
from router.policy import Inflight, Policy
from router.serving import ServingPath, choose_path
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. ``stop``: stop strings (handled here); ``max_tokens`` counts every
    generated token including the first."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Delta:
    """A piece of output: new token ids and the text safe to show. The last delta of a request
    has ``finish_reason`` ("stop" | "length"); ``completion_tokens`` counts tokens so far."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class _Retry(Exception):
    """This placement failed in a way another pair may not; retry if attempts remain."""


@dataclass
class _Run:
    """Output state of one request across attempts."""

    req: GenerationRequest
    detok: object
    stop_ids: frozenset[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    failed_workers: set[str] = field(default_factory=set)  # tried last on the next attempt

    def add(self, token: int) -> str:
        self.generated.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self.detok.flush()
        text = self.detok.add(token)
        if self.detok.stopped_by is not None:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.req.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            text += self.detok.flush()
        return text

    def delta(self, text: str, tokens: list[int]) -> Delta:
        return Delta(text, tuple(tokens), self.finish_reason, len(self.req.prompt_token_ids),
                     len(self.generated))


class _Holding:
    """Which workers hold an attempt, for release."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.decode: Member | None = None
        self.prefill: Member | None = None
        self.prefill_call: asyncio.Task | None = None
        self.done = False


class Orchestrator:
    """Runs requests on the cluster described by ``membership``.

    ``generate`` must be iterated inside one event loop; ``close()`` closes the loop's channels.
    """

    def __init__(self, config: RouterConfig, membership: Membership, tokenizer,
                 policy: Policy, metrics: RouterMetrics, metadata: tuple = ()):
        self.config = config
        self.membership = membership
        self.tokenizer = tokenizer
        self.policy = policy
        self.metrics = metrics
        self.inflight = Inflight()
        self._md = metadata
        self._channels: dict[str, tuple[int, grpc.aio.Channel]] = {}
        self._capacity: asyncio.Condition | None = None
        self._background: set[asyncio.Task] = set()

    async def close(self) -> None:
        """Wait for pending releases (bounded), then close every channel."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.rpc_timeout_s * 2)
        for _, channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- the request --------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Yield deltas until the request finishes. Raises `NoWorkers`, `CapacityTimeout`,
        `InvalidRequest` (a worker rejected the input) or `UpstreamError` (attempts used up);
        after the first delta only `UpstreamError`. Closing the iterator early (client gone)
        releases everything the request holds."""
        stop_ids = frozenset() if req.ignore_eos else frozenset(self.tokenizer.stop_token_ids)
        run = _Run(req, self.tokenizer.detokenizer(req.stop), stop_ids)
        path = self._path(len(req.prompt_token_ids))
        self.metrics.requests_by_path.labels(path.value).inc()
        place = self._attempt if path is ServingPath.DISAGGREGATED else self._colocated_attempt
        for attempt in range(1, self.config.max_attempts + 1):
            rid = req.request_id if attempt == 1 else f"{req.request_id}~{attempt}"
            try:
                async with aclosing(place(rid, run)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except _Retry as exc:
                log.warning("request %s attempt %d failed: %s", rid, attempt, exc)
                if attempt == self.config.max_attempts:
                    raise UpstreamError(f"request failed on {attempt} attempts; last: {exc}") from exc
                self.metrics.retries.inc()
                if run.generated:
                    self.metrics.migrations.inc()
                await asyncio.sleep(0.05 * attempt)

    async def _attempt(self, rid: str, run: _Run) -> AsyncIterator[Delta]:
        prompt = list(run.req.prompt_token_ids) + run.generated
        remaining = run.req.max_tokens - len(run.generated)
        sampling = self._sampling(run, remaining)
        hold = _Holding(rid)
        try:
            reservation = await self._reserve(hold, len(prompt), remaining, run.failed_workers)
            first = await self._prefill(hold, prompt, sampling, reservation, run.failed_workers)
            text = run.add(first.first_token)
            yield run.delta(text, [first.first_token])
            if run.finish_reason is not None:
                return
            async with aclosing(self._decode(hold, run, prompt, first, sampling)) as deltas:
                async for delta in deltas:
                    yield delta
            hold.done = True
        except _Retry:
            run.failed_workers.update(m.worker_id for m in (hold.decode, hold.prefill) if m)
            raise
        finally:
            self._notify_capacity()
            if not hold.done and hold.decode is not None:
                self._spawn(self._release(hold))

    def _path(self, prompt_tokens: int) -> ServingPath:
        c = self.config
        pair = c.serving_mode == "auto" and bool(self._decode_candidates())
        return choose_path(c.serving_mode, c.colocated_threshold_tokens, prompt_tokens, pair)

    async def _colocated_attempt(self, rid: str, run: _Run) -> AsyncIterator[Delta]:
        prompt = list(run.req.prompt_token_ids) + run.generated
        sampling = self._sampling(run, run.req.max_tokens - len(run.generated))
        hold = _Holding(rid)
        try:
            hold.decode = await self._pick_colocated(len(prompt), run.failed_workers)
            call = self._decode_stub(hold.decode).Generate(
                pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
                timeout=self.config.decode_timeout_s, metadata=self._md)
            async with aclosing(self._stream(call, hold, run)) as deltas:
                async for delta in deltas:
                    yield delta
            hold.done = True
        except _Retry:
            run.failed_workers.update(m.worker_id for m in (hold.decode,) if m)
            raise
        finally:
            self._notify_capacity()
            if not hold.done and hold.decode is not None:
                self._spawn(self._release(hold))

    async def _pick_colocated(self, num_tokens: int, avoid: set[str]) -> Member:
        start = time.monotonic()
        while not (decodes := self.membership.routable("decode")):
            waited = time.monotonic() - start  # as _reserve: a restarted router waits briefly
            if waited >= self.config.wait_for_workers_s:
                raise NoWorkers("no decode worker is available")
            await self._wait_capacity(min(0.25, self.config.wait_for_workers_s - waited))
        need = -(-num_tokens // max(1, decodes[0].block_size))
        d = _last(self.policy.order_decode(decodes, self.inflight, need), avoid)[0]
        self.inflight.add_reservation(d, need)  # until heartbeats show its load
        return d

    def _sampling(self, run: _Run, remaining: int) -> pb.SamplingParams:
        r = run.req
        msg = pb.SamplingParams(max_tokens=remaining, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop_token_ids=sorted(run.stop_ids),
                                ignore_eos=r.ignore_eos)
        if r.seed is not None:
            msg.seed = r.seed
        return msg

    # -- reserve ------------------------------------------------------------------------------
    async def _reserve(self, hold: _Holding, num_tokens: int, max_tokens: int,
                       avoid: set[str]) -> pb.ReserveResponse:
        deadline = time.monotonic() + self.config.reserve_timeout_s
        self.metrics.queue_depth.inc()
        try:
            while True:
                decodes = self._decode_candidates()
                if not decodes:
                    # a restarted router waits for workers to re-register, briefly
                    waited = time.monotonic() - (deadline - self.config.reserve_timeout_s)
                    if waited >= self.config.wait_for_workers_s:
                        raise NoWorkers("no connected prefill/decode worker pair is available")
                    await self._wait_capacity(min(0.25, self.config.wait_for_workers_s - waited))
                    continue
                need = -(-num_tokens // max(1, decodes[0].block_size))
                for d in _last(self.policy.order_decode(decodes, self.inflight, need), avoid):
                    resp = await self._try_reserve(d, hold.request_id, num_tokens, max_tokens)
                    if resp is not None:
                        self.inflight.add_reservation(d, len(resp.block_ids))
                        hold.decode = d
                        return resp
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityTimeout(
                        f"no decode worker had room for {num_tokens} prompt tokens within "
                        f"{self.config.reserve_timeout_s:g}s")
                await self._wait_capacity(min(left, self.config.heartbeat_interval_s))
        finally:
            self.metrics.queue_depth.dec()

    async def _try_reserve(self, d: Member, rid: str, num_tokens: int,
                           max_tokens: int) -> pb.ReserveResponse | None:
        try:
            return await self._decode_stub(d).Reserve(
                pb.ReserveRequest(request_id=rid, num_prompt_tokens=num_tokens, max_tokens=max_tokens),
                timeout=self.config.rpc_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"decode worker rejected the request: {exc.details()}") from exc
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.warning("Reserve on %s failed: %s %s", d.worker_id, exc.code(), exc.details())
            return None

    def _decode_candidates(self) -> list[Member]:
        prefills = {m.worker_id for m in self.membership.routable("prefill")}
        return [d for d in self.membership.routable("decode") if d.peers & prefills]

    async def _wait_capacity(self, timeout: float) -> None:
        if self._capacity is None:
            self._capacity = asyncio.Condition()
        async with self._capacity:
            try:
                await asyncio.wait_for(self._capacity.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _notify_capacity(self) -> None:
        if self._capacity is not None:
            self._spawn(self._notify_all())

    async def _notify_all(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    # -- prefill ------------------------------------------------------------------------------
    async def _prefill(self, hold: _Holding, prompt: list[int], sampling: pb.SamplingParams,
                       reservation: pb.ReserveResponse, avoid: set[str]) -> pb.PrefillResponse:
        prefills = [p for p in self.membership.routable("prefill")
                    if hold.decode.worker_id in p.peers]
        if not prefills:
            raise _Retry(f"no prefill worker is linked to {hold.decode.worker_id}")
        p = _last(self.policy.order_prefill(prefills, self.inflight), avoid)[0]
        hold.prefill = p
        req = pb.PrefillRequest(request_id=hold.request_id, token_ids=prompt, sampling=sampling,
                                decode_worker_id=hold.decode.worker_id,
                                block_ids=reservation.block_ids, slot=reservation.slot,
                                generation=reservation.generation)
        self.inflight.start_prefill(p.worker_id, len(prompt))
        call = self._prefill_stub(p).Prefill(req, timeout=self.config.prefill_timeout_s,
                                             metadata=self._md)
        hold.prefill_call = asyncio.ensure_future(_settle(call))
        try:
            # shielded: a cancelled request still learns when the writer stopped (see _release)
            resp, code, details = await asyncio.shield(hold.prefill_call)
        finally:
            self.inflight.end_prefill(p.worker_id, len(prompt))
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequest(f"prefill worker rejected the request: {details}")
        if code != grpc.StatusCode.OK:
            raise _Retry(f"Prefill on {p.worker_id}: {code.name} {details}")
        self.metrics.kv_bytes.inc(resp.bytes_written)
        self.metrics.kv_seconds.observe(resp.transfer_seconds)
        self.metrics.prefill_seconds.observe(resp.prefill_seconds)
        return resp

    # -- decode -------------------------------------------------------------------------------
    async def _decode(self, hold: _Holding, run: _Run, prompt: list[int],
                      first: pb.PrefillResponse, sampling: pb.SamplingParams) -> AsyncIterator[Delta]:
        call = self._decode_stub(hold.decode).Decode(
            pb.DecodeRequest(request_id=hold.request_id, first_token=first.first_token,
                             num_writes=first.num_writes, sampling=sampling,
                             prompt_token_ids=prompt),
            timeout=self.config.decode_timeout_s, metadata=self._md)
        async with aclosing(self._stream(call, hold, run)) as deltas:
            async for delta in deltas:
                yield delta

    async def _stream(self, call, hold: _Holding, run: _Run) -> AsyncIterator[Delta]:
        """Deltas of a ``Decode`` or ``Generate`` token stream; a router-side stop cancels the
        call and releases ``hold``; the call is cancelled if the reader goes away."""
        try:
            while True:
                chunk = await self._read(call, hold)
                tokens, text = [], ""
                for t in chunk.token_ids:
                    if run.finish_reason is None:
                        tokens.append(t)
                        text += run.add(t)
                if chunk.finish_reason == "abort" and run.finish_reason is None:
                    raise _Retry(f"decode worker {hold.decode.worker_id} aborted the request")
                if chunk.finish_reason and run.finish_reason is None:
                    run.finish_reason = chunk.finish_reason
                    text += run.detok.flush()
                if tokens or run.finish_reason is not None:
                    yield run.delta(text, tokens)
                if run.finish_reason is not None:
                    if not chunk.finish_reason:  # a stop string: the worker keeps going otherwise
                        call.cancel()
                        self._spawn(self._release(hold))
                    return
        finally:
            if not call.done():
                call.cancel()

    async def _read(self, call, hold: _Holding) -> pb.TokenChunk:
        try:
            chunk = await asyncio.wait_for(call.read(), self.config.decode_stall_s)
        except asyncio.TimeoutError as exc:
            raise _Retry(f"no token from {hold.decode.worker_id} for "
                         f"{self.config.decode_stall_s:g}s") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"decode worker rejected the request: {exc.details()}") from exc
            raise _Retry(f"Decode on {hold.decode.worker_id}: {exc.code().name} {exc.details()}") from exc
        if chunk is grpc.aio.EOF:
            raise _Retry(f"Decode stream from {hold.decode.worker_id} ended without a finish reason")
        return chunk

    # -- release ------------------------------------------------------------------------------
    async def _release(self, hold: _Holding) -> None:
        """Abort the attempt on its workers: prefill first, then decode (see module doc).

        The writer has stopped when no prefill was asked, when Prefill answered OK, or when the
        prefill worker acknowledged our Abort (it returns once its posted writes completed) and
        its Prefill call has then ended other than by our own deadline.
        """
        t = self.config.rpc_timeout_s
        writer_stopped = hold.prefill is None
        if hold.prefill is not None:
            settled = hold.prefill_call.result() if hold.prefill_call.done() else None
            if settled is not None and settled[1] == grpc.StatusCode.OK:
                writer_stopped = True
            else:
                try:
                    await self._prefill_stub(hold.prefill).Abort(
                        pb.AbortRequest(request_id=hold.request_id), timeout=t,
                        metadata=self._md)
                    acked = True
                except grpc.aio.AioRpcError as exc:
                    acked = False
                    log.warning("Abort(%s) on %s: %s", hold.request_id, hold.prefill.worker_id, exc.code())
                _, code, _ = await hold.prefill_call
                writer_stopped = acked and code != grpc.StatusCode.DEADLINE_EXCEEDED
        try:
            await self._decode_stub(hold.decode).Abort(
                pb.AbortRequest(request_id=hold.request_id, writer_stopped=writer_stopped),
                timeout=t, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            log.warning("Abort(%s) on %s: %s", hold.request_id, hold.decode.worker_id, exc.code())
        self._notify_capacity()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- channels -----------------------------------------------------------------------------
    def _channel(self, m: Member) -> grpc.aio.Channel:
        entry = self._channels.get(m.worker_id)
        if entry is None or entry[0] != m.epoch:
            if entry is not None:
                self._spawn(entry[1].close())
            entry = (m.epoch, self.config.tls.aio_channel(m.grpc_address))
            self._channels[m.worker_id] = entry
        return entry[1]

    def _decode_stub(self, m: Member) -> pbg.DecodeStub:
        return pbg.DecodeStub(self._channel(m))

    def _prefill_stub(self, m: Member) -> pbg.PrefillStub:
        return pbg.PrefillStub(self._channel(m))

    async def stats(self, m: Member) -> pb.StatsResponse:
        """``Stats`` of one worker (used by /admin/workers?stats=1)."""
        stub = self._prefill_stub(m) if m.role == "prefill" else self._decode_stub(m)
        return await stub.Stats(pb.StatsRequest(), timeout=self.config.rpc_timeout_s,
                                metadata=self._md)


async def _settle(call) -> tuple[pb.PrefillResponse | None, grpc.StatusCode, str]:
    """Await a unary call; (response, status code, details) instead of raising."""
    try:
        return await call, grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return None, exc.code(), exc.details() or ""


def _last(members: list[Member], avoid: set[str]) -> list[Member]:
    """``members`` with those in ``avoid`` moved to the end (order otherwise kept)."""
    return sorted(members, key=lambda m: m.worker_id in avoid)
