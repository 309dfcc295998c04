"""The single-process generator: prefill then decode with continuous batching.

Lifecycle of a request: `Generator.add_request` validates it and queues it (WAITING). Each
`Generator.step` runs ONE forward pass holding every running sequence (one new token each) and,
if sequences wait and blocks allow, prompt tokens: up to ``max_num_batched_tokens`` when nothing
decodes, else up to ``max_prefill_tokens_while_decoding`` and what the measured prompt rate computes in
``max_prefill_seconds_while_decoding`` (several prompts at once; a long prompt
is split into chunks over several steps). A sequence whose whole prompt is computed samples its
first token and joins the running batch. Decoding never waits for a burst of prompts: each step
costs it at most one bounded chunk. Which prompts, and how many per pass, follow the prefill
worker's rules (`engine.scheduling`): highest response ratio first (a burst shortest first), and
after a pass's first prompt others join only whole and only within ``prefill_batch_tokens``
(the prefill worker's throughput knee; a decode worker passes its step budget).
Sequences join and leave the running batch between steps. A finished or aborted sequence frees its
blocks at once. When the pool runs out during decode, the most recently admitted sequence is
preempted (blocks freed, recomputed later from prompt + generated tokens).

This class is the reference for greedy output and the colocated baseline. It is not thread-safe:
one thread drives it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence as Seq


from engine.attention import SeqChunk
from engine.config import MIN_TIMED_PREFILL_TOKENS, SchedulerConfig
from engine.errors import CapacityError, InvalidRequestError
from engine.grammar import Grammars, matcher_for
from engine.ids import BlockId, RequestId
from engine.kv_cache import KVPool, blocks_needed
from engine.models.base import CausalLM, check_pool
from engine.runner import ModelRunner
from engine.sampling import SamplingError, SamplingParams, TokenLogprobs, child_params
from engine.scheduling import PassBudget, RateMeter, by_response_ratio, fill_pass
from engine.sequence import FinishReason, Sequence, SeqStatus, token_finish_reason


@dataclass
class StepOutput:
    """What one step produced for one request.

    Attributes:
        new_token_ids: tokens generated this step (0 or 1).
        text_delta: new text safe to show (stop strings held back), when a tokenizer is set.
        finish_reason: set when the request finished this step.
        logprobs: one `TokenLogprobs` per new token when the request asked for logprobs.
        prompt_logprobs: with the first token, when asked for: one per prompt token after the
            first.
        index: the choice (n > 1) this output belongs to.
        request_finished: every choice of the request has finished (with n = 1: ``finished``).
    """

    request_id: RequestId
    new_token_ids: list[int]
    text_delta: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0
    request_finished: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """A finished request: its tokens, text and why it stopped."""

    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


class Generator:
    """Continuous-batching generator over one model and one KV pool.

    Args:
        model: the `CausalLM`.
        pool: the `KVPool` (its allocator is shared with the caller: the decode worker reserves
            blocks from it; the generator frees the blocks of the sequences it holds).
        tokenizer: optional `engine.tokenizer.Tokenizer`; with it, outputs carry text and stop
            strings are honoured, and the template's stop ids end generation.
        grammars: the `engine.grammar.Grammars` for requests with a grammar (default: one for
            ``tokenizer`` when given; without either, such requests are refused).

    ``decode_steps`` counts the passes of decode rows alone (no prompt chunk): ``decode_steps``
    passes, ``decode_step_rows`` rows in them, ``decode_step_seconds`` of wall time (the pass and
    its sampling); the decode worker reports them in its Stats counters, so a served run's mean
    step time and batch size can be read from the worker (``/admin/workers?stats=true``).
    """

    def __init__(self, model: CausalLM, pool: KVPool, tokenizer=None,
                 scheduler: SchedulerConfig = SchedulerConfig(), grammars: Grammars | None = None):
        check_pool(model, pool)
        self.model = model
        self.pool = pool
        self.runner = ModelRunner(model, pool, scheduler.prefix_caching, scheduler.parallel_min_tokens)
        self.tokenizer = tokenizer
        self.config = scheduler
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_rate = RateMeter()   # prompt tokens/s of passes with prompts (HRRN's service time)
        # passes of decode rows alone: their count, rows and seconds (the pass, sampling included)
        self.decode_steps = {"decode_steps": 0, "decode_step_rows": 0, "decode_step_seconds": 0.0}
        self._by_id: dict[RequestId, Sequence] = {}
        self._families: dict[RequestId, list[Sequence]] = {}   # request -> its sequences (n > 1)
        self._stop_ids = frozenset(tokenizer.stop_token_ids) if tokenizer else frozenset()
        if grammars is None and tokenizer is not None:
            grammars = Grammars(tokenizer, tokenizer.stop_token_ids)
        self.grammars = grammars

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a request.

        Raises:
            InvalidRequestError / ContextLengthError: bad prompt or max_tokens.
            CapacityError: prompt + max_tokens needs more blocks than the whole pool holds.
            ValueError: ``request_id`` is already in flight.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        need = blocks_needed(len(prompt_token_ids) + params.max_tokens, self.pool.block_size)
        if need > self.pool.num_blocks:
            raise CapacityError(
                f"request needs {need} KV blocks; the pool holds {self.pool.num_blocks}")
        self.waiting.append(seq)
        self._register(seq)

    def _register(self, seq: Sequence) -> None:
        self._by_id[seq.request_id] = seq
        self._families.setdefault(seq.request, []).append(seq)

    def add_prefilled(self, request_id: str, prompt_token_ids: Seq[int], first_tokens: Seq[int],
                      block_table: Seq[BlockId], params: SamplingParams) -> list[StepOutput]:
        """Join a request whose prompt K/V already sit in ``block_table`` (written by a prefill
        worker) to the running batch, with the first tokens the prefill sampled, one per choice
        (``params.n`` > 1: the sequence forks here, `_fork`).

        Ownership of ``block_table`` passes to the generator: it frees the blocks when the request
        finishes or is aborted. The first token counts towards ``max_tokens`` and stop checks; the
        next `step` computes its K/V and samples the second token. When ``max_num_seqs`` are
        running already it waits (its blocks held) until the batch has room.

        Returns:
            The `StepOutput` of each choice whose first token already ends it (its blocks freed).
        Raises:
            InvalidRequestError / ContextLengthError: as `add_request`; a first token outside the
                vocabulary, or not ``params.n`` of them.
            CapacityError: no free block for a choice's copy of the last prompt block (n > 1).
            ValueError: duplicate request id, or ``block_table`` too short for the prompt.
        """
        firsts = [int(t) for t in first_tokens]
        if len(block_table) * self.pool.block_size < len(prompt_token_ids):
            raise ValueError(f"{len(block_table)} blocks cannot hold a {len(prompt_token_ids)}-token prompt")
        if len(firsts) != params.n or not all(0 <= t < self.model.config.vocab_size for t in firsts):
            raise InvalidRequestError(f"{params.n} first tokens inside the vocabulary expected, got {firsts}")
        seq = self._new_sequence(request_id, prompt_token_ids, child_params(params, 0))
        seq.block_table, seq.num_computed = list(block_table), len(prompt_token_ids)
        family = [seq] + self._fork(seq, params)
        for s in family:
            self._register(s)
            if len(self.running) < self.config.max_num_seqs:
                s.status = SeqStatus.RUNNING
                self.running.append(s)
            else:   # the batch is full: it waits, its KV in place; the next prefill pass computes
                self.waiting.append(s)   # its first token's K/V and samples the second
        outs = [self._append(s, t) for s, t in zip(family, firsts)]
        return [o for o in outs if o.finished]

    def _fork(self, seq: Sequence, params: SamplingParams) -> list[Sequence]:
        """Choices 1 .. n-1 of ``seq``'s request, each a sequence sharing its prompt's full
        blocks (reference counted) and owning a copy of its partial last prompt block (the
        choices write different tokens there); not yet registered.

        Raises:
            CapacityError: no free block for a copy (nothing is kept).
        """
        if params.n == 1:
            return []
        bs, prompt_len = self.pool.block_size, len(seq.prompt_token_ids)
        full, partial = divmod(prompt_len, bs)
        shared = seq.block_table[:full]
        copies = self.pool.allocator.try_allocate((params.n - 1) if partial else 0)
        if copies is None:
            raise CapacityError(f"no free KV block to fork {seq.request_id} into {params.n} choices")
        children = []
        for i in range(1, params.n):
            child = self._new_sequence(f"{seq.request_id}/{i}", seq.prompt_token_ids, child_params(params, i))
            child.parent, child.index = seq.request_id, i
            self.pool.allocator.incref(shared)
            child.block_table = list(shared)
            if partial:
                dst = copies[i - 1]
                self.pool.copy_blocks([seq.block_table[full]], [dst])
                child.block_table.append(dst)
            child.num_computed = prompt_len
            children.append(child)
        return children

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> Sequence:
        rid = RequestId(request_id)
        if rid in self._by_id:
            raise ValueError(f"request {rid!r} is already in flight")
        self.runner.validate(prompt_token_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._stop_ids)
        seq = Sequence(rid, list(prompt_token_ids), params, stop_ids, generator=params.make_generator())
        seq.matcher = matcher_for(self.grammars, params, prompt_token_ids)
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.detokenizer(params.stop, params.min_tokens - params.num_resumed)
        return seq

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request (every choice; ``request_id`` may name any of its sequences) and free
        its blocks; returns the last output (``request_finished``), None when not in flight."""
        seq = self._by_id.get(RequestId(request_id))
        if seq is None:
            return None
        out = None
        for member in list(self._families.get(seq.request, [seq])):
            if member.status != SeqStatus.FINISHED:
                member.finish(FinishReason.ABORT)
                out = self._retire(member, [], "")
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.allocator.num_free

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one pass (running sequences + prompt chunks); returns the outputs of the requests
        it touched."""
        decode = self._schedule_decode() if self.running else []
        budget = self.config.max_num_batched_tokens - len(decode)
        if decode:
            budget = min(budget, self.prefill_tokens_while_decoding())
        prompts = self._schedule_prefill(budget)
        if not decode and not prompts:
            return []
        t0 = time.perf_counter()
        outputs = self._run(decode + prompts)
        seconds = time.perf_counter() - t0
        if prompts:   # the pass's time, decode rows included: what a prompt waits for per pass
            self.prefill_rate.add(sum(len(c.token_ids) for _, c in prompts), seconds)
        else:
            counts = self.decode_steps
            counts["decode_steps"] += 1
            counts["decode_step_rows"] += len(decode)
            counts["decode_step_seconds"] += seconds
        return outputs

    def prefill_tokens_while_decoding(self) -> int:
        """The most prompt tokens a step carries beside decoding sequences now:
        ``max_prefill_tokens_while_decoding``, and with ``max_prefill_seconds_while_decoding`` at
        most what the measured rate of passes with prompts computes in that time, at least
        `MIN_TIMED_PREFILL_TOKENS` (`SchedulerConfig`)."""
        c = self.config
        if c.max_prefill_seconds_while_decoding <= 0:
            return c.max_prefill_tokens_while_decoding
        timed = int(self.prefill_rate.tokens_per_s * c.max_prefill_seconds_while_decoding)
        return min(c.max_prefill_tokens_while_decoding, max(MIN_TIMED_PREFILL_TOKENS, timed))

    def _prefill_order(self) -> list[Sequence]:
        """The waiting sequences in the order they may take prompt tokens (`SchedulerConfig.
        prefill_order`): those already started first, in queue order, then the fresh ones."""
        started, fresh = [], []
        for s in self.waiting:
            (started if s.num_computed or s.output_token_ids or s.block_table else fresh).append(s)
        if self.config.prefill_order == "hrrn" and len(fresh) > 1:
            fresh = by_response_ratio(fresh, time.monotonic(), self.prefill_rate.tokens_per_s,
                                      queued_at=lambda s: s.queued_at, remaining=lambda s: s.num_tokens)
        return started + fresh

    def _schedule_prefill(self, budget: int) -> list[tuple[Sequence, SeqChunk]]:
        if budget <= 0 or not self.waiting:
            return []
        runner = self.runner
        picked: list[Sequence] = []

        def admit(seq: Sequence, take: int) -> bool:
            if len(self.running) + len(picked) >= self.config.max_num_seqs:
                return False
            if seq.num_computed == 0 and not seq.block_table:
                runner.take_cached_prefix(seq)
            end = min(seq.num_computed + take, seq.num_tokens)
            if not runner.grow(seq, end + (1 if end == seq.num_tokens else 0)):   # + the next token's slot
                return False
            picked.append(seq)
            return True

        passes = fill_pass(self._prefill_order(), PassBudget(budget, self.config.prefill_batch_tokens),
                           runner.tokens_to_compute, admit)
        scheduled = []
        for seq, take in passes:
            tokens = seq.all_token_ids
            end = min(seq.num_computed + take, len(tokens))
            want_prompt = seq.params.prompt_logprobs is not None and not seq.output_token_ids
            if want_prompt and seq.num_computed == 0:
                seq.prompt_logprobs = []
            scheduled.append((seq, SeqChunk(tokens[seq.num_computed:end], seq.num_computed, seq.block_table,
                                            need_logits=end == len(tokens), prompt_logits=want_prompt)))
        return scheduled

    def _schedule_decode(self) -> list[tuple[Sequence, SeqChunk]]:
        for seq in list(self.running):
            while seq.status == SeqStatus.RUNNING and not self.runner.grow(seq, seq.num_tokens):
                self._preempt(self.running[-1])
        return [(s, SeqChunk([s.all_token_ids[-1]], s.num_tokens - 1, s.block_table))
                for s in self.running]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.runner.reset(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _run(self, scheduled: list[tuple[Sequence, SeqChunk]]) -> list[StepOutput]:
        logits = self.runner.execute(scheduled)
        for seq, chunk in scheduled:
            self.runner.advance(seq, len(chunk.token_ids))
        outputs = []
        sampled_seqs, rows = [], []
        for row, seq in enumerate(s for s, c in scheduled if c.need_logits):
            family = [seq]
            if seq.params.n > 1 and not seq.output_token_ids:   # the prompt is in: fork here
                params = seq.params
                seq.params = child_params(params, 0)
                try:
                    family += self._fork(seq, params)
                except CapacityError:
                    seq.finish(FinishReason.ERROR)
                    outputs.append(self._retire(seq, [], ""))
                    continue
                for child in family[1:]:
                    self._register(child)
                    self.waiting.append(child)
            sampled_seqs += family
            rows += [row] * len(family)
        for seq, (token, lp) in zip(sampled_seqs, self.runner.sample(logits, sampled_seqs, rows)):
            if isinstance(token, SamplingError):   # this sequence fails alone
                seq.finish(FinishReason.ERROR)
                outputs.append(self._retire(seq, [], ""))
                continue
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.RUNNING
            outputs.append(self._append(seq, token, lp))
        return outputs

    def _append(self, seq: Sequence, token: int, lp: TokenLogprobs | None = None) -> StepOutput:
        out = self._append_token(seq, token, lp)
        if seq.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        return out

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> StepOutput:
        seq.output_token_ids.append(token)
        delta = ""
        if seq.matcher is not None and token not in seq.stop_token_ids and not seq.matcher.consume([token]):
            seq.finish(FinishReason.ERROR)   # the grammar allowed it, so this is a bug; this sequence alone
            return self._retire(seq, [], "")
        reason = token_finish_reason(token, seq.stop_token_ids, len(seq.output_token_ids), seq.params.max_tokens,
                                     seq.num_tokens, self.model.config.max_position)
        if reason is not FinishReason.STOP and seq.detokenizer is not None:
            delta = seq.detokenizer.add(token)
            if seq.detokenizer.stopped_by is not None:
                reason = FinishReason.STOP
        if reason is not None:
            seq.finish(reason)
        if seq.status == SeqStatus.FINISHED:
            if seq.detokenizer is not None:
                delta += seq.detokenizer.flush()
            return self._retire(seq, [token], delta, lp)
        seq.text += delta
        return StepOutput(seq.request, [token], delta, None, len(seq.prompt_token_ids),
                          len(seq.output_token_ids), [lp] if lp is not None else [], index=seq.index)

    def _retire(self, seq: Sequence, new_tokens: list[int], delta: str,
                lp: TokenLogprobs | None = None) -> StepOutput:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.runner.release(seq)
        seq.text += delta
        del self._by_id[seq.request_id]
        family = self._families.get(seq.request, [])
        done = all(m.status == SeqStatus.FINISHED for m in family)
        if done:
            self._families.pop(seq.request, None)
        return StepOutput(seq.request, new_tokens, delta, seq.finish_reason,
                          len(seq.prompt_token_ids), len(seq.output_token_ids), [lp] if lp is not None else [],
                          index=seq.index, request_finished=done)

    # -- convenience ----------------------------------------------------------------------
    def generate(self, prompts: Iterable[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 arrival_steps: Seq[int] | None = None) -> list[GenerationResult]:
        """Run requests to completion; request ``i`` is added at step ``arrival_steps[i]``.

        Returns results in the order of ``prompts``.
        """
        prompts = [list(p) for p in prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        arrivals = list(arrival_steps) if arrival_steps is not None else [0] * len(prompts)
        tokens: dict[str, list[int]] = {}
        texts: dict[str, str] = {}
        reasons: dict[str, FinishReason] = {}
        pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        step = 0
        while pending or self.has_unfinished():
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                self.add_request(f"gen-{i}", prompts[i], plist[i])
                tokens[f"gen-{i}"], texts[f"gen-{i}"] = [], ""
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                texts[out.request_id] += out.text_delta
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
            step += 1
        return [GenerationResult(RequestId(f"gen-{i}"), prompts[i], tokens[f"gen-{i}"],
                                 texts[f"gen-{i}"], reasons[f"gen-{i}"]) for i in range(len(prompts))]
