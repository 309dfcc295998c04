"""One request end to end, over grpc.aio (ARCHITECTURE.md, "One request, end to end").

Lifecycle of a request (`Orchestrator.generate`, an async iterator of `Delta`):

    place     through the admission queue (`router.admission`): a prefill worker with room in
              its budget of in-flight prompt tokens (``prefill_inflight_tokens``) and a decode
              worker (policy) linked to it whose ``Reserve`` succeeds -> a `DecodeLease`
              (blocks, slot, generation, lease). A full decode worker: try the next; none: wait
              in the queue (bounded: `Overloaded` when full, `CapacityTimeout` after
              ``queue_timeout_s``).
              No connected pair for ``wait_for_workers_s``: `NoWorkers`.
    prefill   ``Prefill`` on that prefill worker, its writes bounded by what is left of the
              decode lease -> first token, num_writes. The first token is yielded (TTFT).
    decode    ``Decode`` stream -> tokens, detokenized here; a stop string ends the request
              (the stream is cancelled and the decode worker told to Abort).
    release   on any failure, cancellation (client gone) or router-side stop, the workers
              holding the request are told to Abort, in the order the block-reuse rule needs:
              the prefill worker first (its Abort returns once its posted writes completed),
              then the decode worker with ``writer_stopped`` true only when the writer is known
              to have stopped (Prefill answered, or acknowledged the Abort).

Colocated path (`router.serving` decides per request; in ``auto`` mode, for a prompt either path
may serve, when it is placed): ``ServeColocated`` on one decode worker under
its limit of in-flight requests (``decode_inflight_requests``), placed through the same queue;
it prefills and decodes on its own pool (no reserve, no prefill worker); its stream is read like
``Decode``'s (first chunk = first token), and release is an ``Abort`` of the decode worker alone
(no remote writer: ``writer_stopped`` true).

Workers are called through `router.clients` only: its three exceptions are all this module
handles (`WorkerRejected` -> `InvalidRequest`, `WorkerFull` -> the next worker, `WorkerFailed`
-> retry).

Each placement of a request is an `Attempt` (`router.request`: the workers it holds, for
release). A worker failing before any token reached the client, or dying mid-stream, costs one
attempt (`RouterConfig.max_attempts`); the next attempt re-prefills prompt + tokens generated so
far on a new pair (request id suffixed ``~N``). Bad input found by a worker (INVALID_ARGUMENT) is
not retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import grpc

from engine.block_hash import block_hashes
from router.admission import Admission
from router.clients import (TokenStream, WorkerCallError, WorkerClient, WorkerFailed,
                            WorkerFull, WorkerRejected)
from router.config import RouterConfig
from router.errors import InvalidRequest, NoWorkers, UpstreamError
from router.membership import Member, Membership
from router.metrics import RouterMetrics
from router.policy import Inflight, Policy, avoid_last, sequence_blocks
from router.request import Attempt, Choice, Delta, GenerationRequest
from router.serving import ServingPath, choose_path, colocate_on_placement
from router.warmup import Warmups
from rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)


class _Retry(Exception):
    """This placement failed in a way another pair may not; retry if attempts remain."""


_WRITE_MARGIN_S = 1.0   # the prefill stops posting this long before the decode lease ends


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
        self.admission = Admission(config.max_waiting_requests, config.queue_timeout_s)
        metrics.queue_depth.set_function(lambda: self.admission.waiting)
        self._md = metadata
        self._clients: dict[str, tuple[int, WorkerClient, grpc.aio.Channel]] = {}
        self._colocated: dict[str, int] = defaultdict(int)   # decode id -> ServeColocated calls in flight
        self._background: set[asyncio.Task] = set()
        self.warmups = Warmups(metrics, membership.kv_index, self._client, config.prefill_timeout_s)

    async def close(self) -> None:
        """Cancel warm-ups, wait for pending releases (bounded), then close every channel."""
        await self.warmups.close()
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.rpc_timeout_s * 2)
        for _, _, channel in self._clients.values():
            await channel.close()
        self._clients.clear()

    # -- the request --------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Yield deltas until the request finishes. Raises `NoWorkers`, `Overloaded`,
        `CapacityTimeout`, `InvalidRequest` (a worker rejected the input) or `UpstreamError`
        (attempts used up, or the worker failed the sequence alone); after the first delta only
        `UpstreamError`. Closing the iterator early (client gone) releases everything the
        request holds."""
        stop_ids = frozenset(req.stop_token_ids) | (
            frozenset() if req.ignore_eos else frozenset(self.tokenizer.stop_token_ids))
        failed: set[str] = set()
        runs = [Choice(req, self.tokenizer.detokenizer(req.stop, req.min_tokens), stop_ids, index=i,
                     failed_workers=failed) for i in range(req.n)]
        path, hashes = self._path(req.prompt_token_ids)
        tries = failures = 0
        while True:
            todo = [r for r in runs if r.finish_reason is None]
            if not todo:
                return
            # n > 1: one attempt forks every choice from one prefill; once a choice has output, an
            # unfinished choice is resumed alone (prompt + its output, its own seed stream).
            group = todo if len(todo) == req.n and not any(r.generated for r in todo) else todo[:1]
            tries += 1
            rid = req.request_id if tries == 1 else f"{req.request_id}~{tries}"
            try:
                # the prompt's block hashes serve the first attempt (a resumed one has more tokens)
                async with aclosing(self._attempt(rid, group, path, hashes if tries == 1 else None)) as deltas:
                    async for delta in deltas:
                        yield delta
            except _Retry as exc:
                failures += 1
                log.warning("request %s attempt %d failed: %s", rid, tries, exc)
                if failures >= self.config.max_attempts:
                    raise UpstreamError(f"request failed on {failures} attempts; last: {exc}") from exc
                self.metrics.retries.inc()
                if any(r.generated for r in group):
                    self.metrics.migrations.inc()
                await asyncio.sleep(0.05 * failures)
                continue
            if any(r.finish_reason is None for r in group):
                raise UpstreamError(f"the stream of {rid} ended before its choices finished")

    async def _attempt(self, rid: str, runs: list[Choice], path: ServingPath | None,
                       hashes: list[bytes] | None = None) -> AsyncIterator[Delta]:
        """One placement of ``runs``: every choice of a fresh request (forked from one prefill), or
        one choice resumed alone; on ``path``, or None: where `colocate_on_placement` says then."""
        lead = runs[0]
        prompt = list(lead.req.prompt_token_ids) + lead.generated
        remaining = lead.req.max_tokens - len(lead.generated)
        sampling = self._sampling(runs, remaining)
        attempt = Attempt(rid)
        attempt.hashes = hashes
        try:
            await self.admission.acquire(
                lambda since: self._place_on(path, attempt, prompt, remaining, lead.failed_workers, since))
            if rid == lead.req.request_id:   # a request's first placement: its path
                placed = ServingPath.COLOCATED if attempt.colocated else ServingPath.DISAGGREGATED
                self.metrics.requests_by_path.labels(placed.value).inc()
            if not attempt.colocated:
                first = await self._prefill(attempt, prompt, sampling)
                firsts, reasons, lps = list(first.first_tokens), list(first.finish_reasons), list(first.first_logprobs)
                if len(firsts) != len(runs) or len(reasons) != len(runs):
                    raise UpstreamError(f"the prefill worker sent {len(firsts)} first tokens and {len(reasons)} "
                                        f"finish reasons for {len(runs)} choices")
                for i, (run, token) in enumerate(zip(runs, firsts)):
                    text = run.add(token, reasons[i])
                    yield run.delta(text, [token], lps[i:i + 1], first.prompt_logprobs)
                if all(r.finish_reason is not None for r in runs):
                    return   # the release below frees the reservation (the writer stopped)
                stream = self._client(attempt.decode).decode(rid, firsts, first.num_writes, sampling, prompt,
                                                             self.config.decode_timeout_s)
            else:
                stream = self._client(attempt.decode).serve_colocated(rid, prompt, sampling,
                                                                      self.config.decode_timeout_s)
            async with aclosing(self._stream(stream, attempt, runs)) as deltas:
                async for delta in deltas:
                    yield delta
            attempt.done = True
            self._after_finish(attempt, runs)
        except WorkerRejected as exc:
            raise InvalidRequest(f"the worker rejected the request: {exc.details}") from exc
        except _Retry:
            lead.failed_workers.update(m.worker_id for m in (attempt.decode, attempt.prefill) if m)
            raise
        except WorkerCallError as exc:
            lead.failed_workers.update(m.worker_id for m in (attempt.decode, attempt.prefill) if m)
            raise _Retry(str(exc)) from exc
        finally:
            if attempt.colocated:
                self._colocated[attempt.decode.worker_id] -= 1
                self._colocated_started(attempt)
            self.admission.notify()
            if not attempt.done and attempt.decode is not None:
                self._spawn(self._release(attempt))

    def _path(self, prompt: tuple[int, ...]) -> tuple[ServingPath | None, list[bytes] | None]:
        """The request's path (None: chosen at placement) and, when that needed them, its prompt's
        block hashes. ``auto`` mode: the tokens to compute are the prompt's minus the longest
        prefix a decode worker holds (`router.serving`)."""
        c = self.config
        pair = c.serving_mode == "auto" and bool(self._decode_candidates())
        to_compute, hashes = len(prompt), None
        if c.serving_mode == "auto" and pair and to_compute >= c.colocated_threshold_tokens > 0:
            caching = [d for d in self.membership.routable("decode") if d.prefix_caching]
            if caching:
                bs = max(1, caching[0].block_size)
                hashes = block_hashes(prompt, bs)
                to_compute -= bs * max(self.membership.kv_index.overlap(d.worker_id, hashes) for d in caching)
        return choose_path(c.serving_mode, c.colocated_threshold_tokens, to_compute, pair), hashes

    def _placement_path(self, tokens: int) -> ServingPath:
        """Auto mode: the path of a prompt of ``tokens`` tokens placed now, either way allowed
        (`router.serving.colocate_on_placement` over this router's in-flight counts)."""
        c, prefills = self.config, self.membership.routable("prefill")
        if not self._decode_candidates():
            return ServingPath.COLOCATED   # no linked pair left since it arrived
        colocated = [self.inflight.colocated_tokens.get(d.worker_id, 0) for d in self.membership.routable("decode")]
        return ServingPath.COLOCATED if colocate_on_placement(
            [self.inflight.prefill_tokens.get(p.worker_id, 0) for p in prefills], colocated, tokens,
            c.auto_prefill_backlog_tokens, c.auto_decode_prefill_speed) else ServingPath.DISAGGREGATED

    async def _place_on(self, path: ServingPath | None, attempt: Attempt, prompt: list[int], max_tokens: int,
                        avoid: set[str], since: float) -> bool | None:
        """`_place` or `_place_colocated` by ``path``; None: by `_placement_path` now."""
        if (path or self._placement_path(len(prompt))) is ServingPath.COLOCATED:
            return await self._place_colocated(attempt, prompt, avoid, since)
        return await self._place(attempt, prompt, max_tokens, avoid, since)

    def _prompt_hashes(self, attempt: Attempt, prompt: list[int], block_size: int) -> Sequence[bytes]:
        """The attempt's prompt block hashes for a policy that uses them, computed once."""
        if self.policy.uses_hashes and attempt.hashes is None:
            attempt.hashes = block_hashes(prompt, block_size)
        return attempt.hashes or ()

    def _sampling(self, runs: list[Choice], remaining: int) -> pb.SamplingParams:
        run = runs[0]
        r = run.req
        msg = pb.SamplingParams(max_tokens=remaining, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, min_p=r.min_p, stop_token_ids=sorted(run.stop_ids),
                                ignore_eos=r.ignore_eos, presence_penalty=r.presence_penalty,
                                frequency_penalty=r.frequency_penalty,
                                repetition_penalty=r.repetition_penalty, logit_bias=dict(r.logit_bias),
                                min_tokens=r.min_tokens, num_resumed=len(run.generated), grammar=r.grammar,
                                n=len(runs) if len(runs) > 1 else 0, choice=run.index if len(runs) == 1 else 0)
        if r.seed is not None:
            msg.seed = r.seed
        if r.logprobs is not None:
            msg.logprobs = r.logprobs
        if r.prompt_logprobs is not None and run.index == 0 and not run.prompt_sent:
            msg.prompt_logprobs = r.prompt_logprobs
        return msg

    # -- placement (called by the admission queue) --------------------------------------------
    def _no_workers_yet(self, since: float, what: str) -> None:
        """A restarted router waits ``wait_for_workers_s`` for workers before `NoWorkers`."""
        if time.monotonic() - since >= self.config.wait_for_workers_s:
            raise NoWorkers(what)

    def _prefill_room(self, p: Member, tokens: int) -> bool:
        queued = self.inflight.prefill_tokens.get(p.worker_id, 0)
        return queued == 0 or queued + tokens <= self.config.prefill_inflight_tokens

    async def _place(self, attempt: Attempt, prompt: list[int], max_tokens: int, avoid: set[str],
                     since: float) -> bool | None:
        """Reserve on a decode worker linked to a prefill worker with room; True when placed
        (``attempt`` filled), None when no worker has room now. A decode worker with a prefix
        cache gets the prompt, to hold its cached blocks (delta transfer)."""
        decodes = self._decode_candidates()
        if not decodes:
            self._no_workers_yet(since, "no connected prefill/decode worker pair is available")
            return None
        num_tokens = len(prompt)
        prefills = [p for p in self.membership.routable("prefill") if self._prefill_room(p, num_tokens)]
        room = {p.worker_id for p in prefills}
        bs = max(1, decodes[0].block_size)
        need = -(-num_tokens // bs)
        hashes = self._prompt_hashes(attempt, prompt, bs)
        for d in avoid_last(self.policy.order_decode([d for d in decodes if d.peers & room], self.inflight,
                                                need, hashes), avoid):
            linked = [p for p in prefills if d.worker_id in p.peers]
            prefill = avoid_last(self.policy.order_prefill(linked, self.inflight, need, hashes), avoid)[0]
            attempt.decode = d   # from here a release aborts whatever Reserve left behind
            try:   # the writer is named: the decode worker frees the blocks once it is gone
                attempt.lease = await self._client(d).reserve(attempt.request_id, num_tokens, max_tokens,
                                                              prompt if d.prefix_caching else (), prefill.worker_id)
            except WorkerFull:
                attempt.decode = None
                continue
            except WorkerFailed as exc:
                log.warning("%s", exc)
                self._spawn(self._abort_decode(d, attempt.request_id, writer_stopped=True))
                attempt.decode = None
                continue
            attempt.prefill = prefill
            attempt.prefill_tokens = num_tokens
            self.inflight.add_reservation(d, len(attempt.lease.block_ids) - attempt.lease.num_held_blocks)
            if attempt.hashes:   # they are about to be cached there (router.kvindex)
                self.membership.kv_index.predict(d.worker_id, attempt.hashes)
                self.membership.kv_index.predict(attempt.prefill.worker_id, attempt.hashes)
            if d.prefix_caching:
                self.metrics.prefix_query_tokens.labels("decode").inc(num_tokens)
                self.metrics.prefix_hit_tokens.labels("decode").inc(attempt.lease.num_held_blocks * bs)
            self.inflight.start_prefill(attempt.prefill.worker_id, num_tokens)
            return True
        return None

    async def _place_colocated(self, attempt: Attempt, prompt: list[int], avoid: set[str],
                               since: float) -> bool | None:
        decodes = self.membership.routable("decode")
        if not decodes:
            self._no_workers_yet(since, "no decode worker is available")
            return None
        open_ = [d for d in decodes if self._colocated[d.worker_id] < self.config.decode_inflight_requests]
        if not open_:
            return None
        bs = max(1, decodes[0].block_size)
        need = -(-len(prompt) // bs)
        attempt.decode = avoid_last(self.policy.order_decode(open_, self.inflight, need,
                                                        self._prompt_hashes(attempt, prompt, bs)), avoid)[0]
        attempt.colocated = True
        if attempt.hashes:
            self.membership.kv_index.predict(attempt.decode.worker_id, attempt.hashes)
        self._colocated[attempt.decode.worker_id] += 1
        self.inflight.add_reservation(attempt.decode, need)  # until heartbeats show its load
        attempt.colocated_tokens = len(prompt)   # queued there until its first token
        self.inflight.start_colocated(attempt.decode.worker_id, len(prompt))
        return True

    def _colocated_started(self, attempt: Attempt) -> None:
        """A colocated attempt's prompt left its decode worker's queue (first token, or the end)."""
        if attempt.colocated_tokens:
            self.inflight.end_colocated(attempt.decode.worker_id, attempt.colocated_tokens)
            attempt.colocated_tokens = 0

    def _after_finish(self, attempt: Attempt, runs: list[Choice]) -> None:
        """The decode worker now caches the prompt and what it decoded but the last token: tell
        the KV index before its events do; the prefill worker warms up with the same (`router.warmup`).
        Its blocks are free (or cached) there now, before a heartbeat says so (`Inflight`)."""
        if attempt.decode is not None:
            self.inflight.add_release(attempt.decode, sequence_blocks(len(runs[0].req.prompt_token_ids),
                                                                      [len(r.generated) for r in runs],
                                                                      max(1, attempt.decode.block_size)))
        if attempt.hashes and attempt.decode is not None and attempt.decode.prefix_caching:
            for run in runs:   # each choice's tokens start with the attempt's prompt
                tokens = [*run.req.prompt_token_ids, *run.generated][:-1]
                self.membership.kv_index.predict(attempt.decode.worker_id, attempt.hashes + block_hashes(
                    tokens, attempt.decode.block_size, start=len(attempt.hashes), parent=attempt.hashes[-1]))
        if self.config.prefill_warmup and attempt.prefill is not None and not attempt.colocated:
            self.warmups.after_finish(attempt.prefill, attempt.request_id, runs[0].req.prompt_token_ids,
                                      runs[0].generated)

    def _decode_candidates(self) -> list[Member]:
        prefills = {m.worker_id for m in self.membership.routable("prefill")}
        return [d for d in self.membership.routable("decode") if d.peers & prefills]

    # -- prefill ------------------------------------------------------------------------------
    async def _prefill(self, attempt: Attempt, prompt: list[int], sampling: pb.SamplingParams) -> pb.PrefillResponse:
        held = attempt.lease.num_held_blocks
        req = pb.PrefillRequest(request_id=attempt.request_id, token_ids=prompt, sampling=sampling,
                                decode_worker_id=attempt.decode.worker_id,
                                block_ids=attempt.lease.block_ids[held:], num_held_blocks=held,
                                slot=attempt.lease.slot, generation=attempt.lease.generation,
                                write_deadline_s=attempt.lease.write_deadline_s(_WRITE_MARGIN_S))
        attempt.prefill_call = asyncio.ensure_future(
            self._client(attempt.prefill).prefill(req, self.config.prefill_timeout_s))
        try:
            # shielded: a cancelled request still learns when the writer stopped (see _release)
            resp = await asyncio.shield(attempt.prefill_call)
        finally:
            self.inflight.end_prefill(attempt.prefill.worker_id, attempt.prefill_tokens)
            self.admission.notify()
        self.metrics.kv_bytes.inc(resp.bytes_written)
        self.metrics.kv_bytes_skipped.inc(resp.bytes_skipped)
        if attempt.prefill.prefix_caching:
            self.metrics.prefix_query_tokens.labels("prefill").inc(len(prompt))
            self.metrics.prefix_hit_tokens.labels("prefill").inc(resp.prefix_hit_tokens)
        self.metrics.kv_seconds.observe(resp.transfer_seconds)
        self.metrics.prefill_seconds.observe(resp.prefill_seconds)
        return resp

    # -- decode -------------------------------------------------------------------------------
    async def _stream(self, stream: TokenStream, attempt: Attempt, runs: list[Choice]) -> AsyncIterator[Delta]:
        """Deltas of a ``Decode`` or ``ServeColocated`` token stream (chunk ``index`` i is ``runs[i]``);
        once every choice finished, a router-side stop (a stop string) cancels the call and
        releases ``attempt``; the call is cancelled if the reader goes away."""
        ended: set[int] = set()   # choices the worker finished
        try:
            while True:
                chunk = await stream.read(self.config.decode_stall_s)
                if not 0 <= chunk.index < len(runs):
                    raise UpstreamError(f"decode worker {attempt.decode.worker_id} sent choice {chunk.index} "
                                        f"of {len(runs)}")
                run = runs[chunk.index]
                self._colocated_started(attempt)
                tokens, text, logprobs = [], "", []
                last = len(chunk.token_ids) - 1
                for i, t in enumerate(chunk.token_ids):
                    if run.finish_reason is None:
                        tokens.append(t)
                        if i < len(chunk.logprobs):
                            logprobs.append(chunk.logprobs[i])
                        text += run.add(t, chunk.finish_reason if i == last else None)
                if run.finish_reason is None and chunk.finish_reason == "abort":
                    raise _Retry(f"decode worker {attempt.decode.worker_id} aborted the request")
                if run.finish_reason is None and chunk.finish_reason == "error":
                    attempt.done = True   # the worker already freed it
                    raise UpstreamError(f"decode worker {attempt.decode.worker_id} failed this "
                                        "request's sampling")
                if chunk.finish_reason:
                    ended.add(chunk.index)
                    if run.finish_reason is None:
                        run.finish_reason = chunk.finish_reason
                        text += run.detok.flush()
                if tokens or (run.finish_reason is not None and not run.reported):
                    yield run.delta(text, tokens, logprobs, chunk.prompt_logprobs)
                if all(r.finish_reason is not None for r in runs):
                    if len(ended) < len(runs):  # a stop string: the worker keeps going otherwise
                        stream.cancel()
                        self._spawn(self._release(attempt))
                    return
        finally:
            stream.cancel()

    # -- release ------------------------------------------------------------------------------
    async def _release(self, attempt: Attempt) -> None:
        """Abort the attempt on its workers: prefill first, then decode (see module doc).

        The writer has stopped when no Prefill was sent, when Prefill answered OK, or when the
        prefill worker acknowledged our Abort (it answers once its posted writes completed) and
        its Prefill call has then ended other than by our own deadline.
        """
        writer_stopped = attempt.prefill_call is None
        call = attempt.prefill_call
        if call is not None:
            if call.done() and not call.cancelled() and call.exception() is None:
                writer_stopped = True
            else:
                try:
                    await self._client(attempt.prefill).abort_prefill(attempt.request_id)
                    acked = True
                except WorkerCallError as exc:
                    acked = False
                    log.warning("%s", exc)
                try:
                    await call
                    code = "OK"
                except WorkerCallError as exc:
                    code = exc.code
                writer_stopped = acked and code != grpc.StatusCode.DEADLINE_EXCEEDED.name
        await self._abort_decode(attempt.decode, attempt.request_id, writer_stopped)

    async def _abort_decode(self, d: Member, request_id: str, writer_stopped: bool) -> None:
        try:
            await self._client(d).abort_decode(request_id, writer_stopped)
        except WorkerCallError as exc:
            log.warning("%s", exc)
        self.admission.notify()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- channels -----------------------------------------------------------------------------
    def _client(self, m: Member) -> WorkerClient:
        entry = self._clients.get(m.worker_id)
        if entry is None or entry[0] != m.epoch:
            if entry is not None:
                self._spawn(entry[2].close())
            channel = self.config.tls.aio_channel(m.grpc_address)
            entry = (m.epoch, WorkerClient(m.worker_id, channel, self._md, self.config.rpc_timeout_s), channel)
            self._clients[m.worker_id] = entry
        return entry[1]

    async def stats(self, m: Member) -> pb.StatsResponse:
        """``Stats`` of one worker (used by /admin/workers?stats=1). Raises `WorkerCallError`."""
        return await self._client(m).stats(m.role)
