"""The model runner: the one place a forward pass is prepared, run and sampled.

Every role runs its passes through a `ModelRunner`: the single-process `engine.generator.Generator`
(colocated serving, and the decode worker's loop) and the prefill worker (`prefill.worker`).
Callers own scheduling and request lifecycles; the runner owns the steps between "these chunks of
these sequences" and "these tokens", which a caller makes in this order:

    take_cached_prefix  a sequence with no blocks takes the blocks of its longest cached prefix
                        (prefix caching): those tokens count as computed
    grow                blocks for the positions a pass will write (all or nothing)
    execute             the `ForwardBatch` of a pass built and run through the model over the
                        pool (a per-layer hook: the prefill worker posts each layer's KV writes
                        from it); prompt logprobs gathered; the sampling logits returned
    advance             a chunk's tokens counted as computed, and the blocks they completed
                        registered in the prefix cache (their K/V final)
    sample              tokens and logprobs for sampling rows (n > 1: several rows read one
                        logits row); one row's failure is its own
    release / reset     the sequence's blocks given back, when it is done / to start it over

A `RunnerSeq` is what the runner reads and writes of a sequence (`engine.sequence.Sequence`,
`prefill.job.PrefillJob`). The runner holds no per-request state and takes no lock: one thread
drives it (the block allocator it calls is thread-safe). The model is any `engine.models.base.CausalLM`.
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq

import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.errors import ContextLengthError, InvalidRequestError
from engine.ids import BlockId
from engine.block_hash import block_hashes
from engine.kv_cache import GROWTH_GAP_BLOCKS, KVPool, blocks_needed
from engine.models.base import CausalLM, LayerCallback
from engine.models.rope import LENGTH_DEPENDENT
from engine.sampling import (SampleRow, SamplingError, SamplingParams, TokenLogprobs, compute_logprobs,
                             prompt_logprobs_of, sample)


class RunnerSeq(Protocol):
    """What the runner reads and writes of one sequence.

    ``all_token_ids``: prompt then output tokens; ``num_computed``: leading tokens whose K/V are
    in ``block_table``'s blocks; ``block_hashes``: chained hashes of its full blocks, as far as
    known; ``num_registered``: leading blocks registered in the prefix cache;
    ``prompt_logprobs``: gathered over the prompt's chunks when asked for (else None or [])."""

    params: SamplingParams
    prompt_token_ids: list[int]
    block_table: list[BlockId]
    num_computed: int
    block_hashes: list[bytes]
    num_registered: int
    prompt_logprobs: list[TokenLogprobs] | None

    @property
    def all_token_ids(self) -> list[int]: ...


def validate_request(prompt_token_ids: Seq[int], params: SamplingParams, max_position: int,
                     vocab_size: int) -> None:
    """Check a request against a model's context (``max_position`` tokens) and vocabulary.

    Raises:
        InvalidRequestError: empty prompt, a token id (prompt, ``stop_token_ids``, ``logit_bias``)
            outside ``[0, vocab_size)``, ``num_resumed`` not below the prompt's length.
        ContextLengthError: prompt + ``max_tokens`` does not fit the context.
    """
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    if len(prompt_token_ids) >= max_position:
        raise ContextLengthError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
            f"{max_position} tokens")
    if len(prompt_token_ids) + params.max_tokens > max_position:
        raise ContextLengthError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"this model's context of {max_position} tokens")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids out of the vocabulary range [0, {vocab_size}): {bad[:5]}")
    bad = [t for t in params.token_ids_in_use() if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids / logit_bias name ids outside the vocabulary "
                                  f"[0, {vocab_size}): {bad[:5]}")
    if params.num_resumed >= len(prompt_token_ids):
        raise InvalidRequestError(f"num_resumed ({params.num_resumed}) must be below the prompt's "
                                  f"{len(prompt_token_ids)} tokens")


def prefix_caching_conflict(config) -> str | None:
    """Why a model (its `engine.config.ModelConfig`) cannot share cached KV blocks between
    sequences, or None when it can: a rope type whose rotation depends on the sequence's length
    (`engine.models.rope.LENGTH_DEPENDENT`) rotates a cached block's keys for the length of the
    sequence that wrote them, not of the one reusing them. Workers turn prefix caching off for
    such a model, and log this reason."""
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type in LENGTH_DEPENDENT:
        return (f"prefix caching cannot serve rope_type={scaling.rope_type!r}: its keys are rotated for the "
                "length of the sequence that wrote them")
    return None


class CpuBorrowing(Protocol):
    """CPUs a runner may add threads on for one long pass while their owners are idle
    (`worker.cpu_board.CpuLending`)."""

    def take(self) -> int:
        """Take the lent CPUs idle now for the coming pass; returns how many."""

    def reclaimed(self) -> bool:
        """Whether an owner of a CPU taken has work again."""

    def give_back(self) -> None:
        """End the pass's loan."""


class ModelRunner:
    """Forward passes of one model over one KV pool (module doc for the call order).

    Args:
        model: the `CausalLM`; its ``kv_dtype`` must be the pool's dtype.
        pool: the `KVPool`; the runner allocates from its allocator (shared with the caller,
            who may reserve blocks of its own, as the decode worker does).
        prefix_caching: take cached prefixes and register computed full blocks.
        parallel_min_tokens: a pass of fewer tokens runs on one torch thread, a longer one on
            the ``torch.get_num_threads()`` the process had when the runner was built; 0: every
            pass on all of them. A pass is a few hundred operators, each ending at a barrier of
            all its threads (intra-op parallelism: OpenMP); a short pass (a decode step) has too
            little work per operator to gain from a second thread and waits at every barrier
            for a thread that another process (the router, a client, a second worker) has
            descheduled from a shared core, while a long pass (a prompt chunk) gains (measured:
            docs/PERFORMANCE.md, "Threads per pass").
        borrowing: a pass of at least ``parallel_min_tokens`` tokens also runs a thread on
            each lent CPU idle when it starts (`CpuBorrowing.take`), until its owner has work
            again (checked after each layer; the rest of the pass on the runner's own threads).
            None: no lending (tensor-parallel and CUDA workers, unpinned ones).
    Raises:
        ValueError: ``prefix_caching`` with a rope type whose rotation depends on the sequence's
            length (`engine.models.rope.LENGTH_DEPENDENT`: a cached block's keys would carry the
            rotation of the sequence that wrote them, not of the one reusing them).
    """

    def __init__(self, model: CausalLM, pool: KVPool, prefix_caching: bool = False,
                 parallel_min_tokens: int = 0, borrowing: CpuBorrowing | None = None):
        reason = prefix_caching_conflict(model.config)
        if prefix_caching and reason:
            raise ValueError(f"{reason}; run without --prefix-caching")
        if parallel_min_tokens < 0:
            raise ValueError(f"parallel_min_tokens must be >= 0, got {parallel_min_tokens}")
        self.threads = torch.get_num_threads()
        self.parallel_min_tokens = parallel_min_tokens
        self.model = model
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.graphs = None   # `enable_cuda_graphs`
        self.borrowing = borrowing

    def enable_cuda_graphs(self, max_batch: int) -> float:
        """Replay decode steps of up to ``max_batch`` sequences from CUDA graphs
        (`engine.cuda_graphs.DecodeGraphs`, recorded now; one pool block is held for their
        padding rows); other passes stay eager. Returns the seconds the recording took. Raises
        ValueError where the model's decode step cannot be recorded (the reason named)."""
        import time

        from engine.cuda_graphs import DecodeGraphs

        t0 = time.monotonic()
        self.graphs = DecodeGraphs(self.model, self.pool, max_batch, self.model.config.max_position)
        return time.monotonic() - t0

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """`validate_request` against this model's context and vocabulary."""
        c = self.model.config
        validate_request(prompt_token_ids, params, c.max_position, c.vocab_size)

    # -- blocks ---------------------------------------------------------------------------------
    def prefix_hashes(self, seq: RunnerSeq) -> list[bytes]:
        """The hashes of ``seq``'s cacheable prefix: its full blocks but the last token (whose
        logits pick the next token, so it is always computed); kept in ``seq.block_hashes``.
        Empty with prefix caching off, and for a prompt that wants prompt logprobs (every
        position's logits are needed, so nothing is taken from the cache)."""
        if not self.prefix_caching or (seq.params.prompt_logprobs is not None
                                       and len(seq.all_token_ids) == len(seq.prompt_token_ids)):
            return []
        if not seq.block_hashes:
            tokens = seq.all_token_ids
            seq.block_hashes = block_hashes(tokens[:len(tokens) - 1], self.pool.block_size)
        return seq.block_hashes

    def cached_tokens(self, seq: RunnerSeq) -> int:
        """Tokens of ``seq``'s prefix the cache holds now (no reference taken: a scheduler's
        estimate, the cache may change before `take_cached_prefix`)."""
        hashes = self.prefix_hashes(seq)
        return self.pool.allocator.cached_prefix_blocks(hashes) * self.pool.block_size if hashes else 0

    def tokens_to_compute(self, seq: RunnerSeq) -> int:
        """Tokens of ``seq`` whose K/V are still to compute (>= 1 for a sequence that has not
        computed all): for one holding no blocks yet, less what its cached prefix would give now
        (`cached_tokens`, an estimate)."""
        if seq.block_table:
            return len(seq.all_token_ids) - seq.num_computed
        return len(seq.all_token_ids) - max(seq.num_computed, self.cached_tokens(seq))

    def take_cached_prefix(self, seq: RunnerSeq) -> int:
        """Give ``seq`` (holding no blocks) the cached blocks of its longest cached prefix, a
        reference each; they count as computed and registered. Returns the tokens taken (0 with
        prefix caching off). Raises ValueError when ``seq`` holds blocks already."""
        if seq.block_table:
            raise ValueError("take_cached_prefix: the sequence holds blocks already")
        hashes = self.prefix_hashes(seq)
        hit = self.pool.allocator.lookup(hashes) if hashes else []
        seq.block_table = list(hit)
        seq.num_computed = len(hit) * self.pool.block_size
        seq.num_registered = len(hit)
        return seq.num_computed

    def grow(self, seq: RunnerSeq, num_tokens: int) -> bool:
        """Make ``seq.block_table`` cover ``num_tokens`` positions; False (nothing taken) when
        the pool cannot give the missing blocks now. The new blocks follow the table's last block
        where free, else start a run with room for the sequence to grow into (up to
        `GROWTH_GAP_BLOCKS` blocks, as far as ``max_tokens`` lets it grow): see
        `BlockAllocator.try_allocate`."""
        bs = self.pool.block_size
        extra = blocks_needed(num_tokens, bs) - len(seq.block_table)
        if extra <= 0:
            return True
        final = len(seq.prompt_token_ids) + seq.params.max_tokens   # the most it can grow to
        gap = min(max(blocks_needed(final, bs) - blocks_needed(num_tokens, bs), 0), GROWTH_GAP_BLOCKS)
        blocks = self.pool.allocator.try_allocate(
            extra, after=seq.block_table[-1] if seq.block_table else None, gap=gap)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def release(self, seq: RunnerSeq) -> None:
        """Give back ``seq``'s blocks, once it is done (finished, failed, retired): a cached block
        stays in the cache, evictable. ``seq.num_computed`` is kept as the record of how far it
        got."""
        if seq.block_table:
            self.pool.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_registered = 0

    def reset(self, seq: RunnerSeq) -> None:
        """Give back ``seq``'s blocks to start it over (preemption, or blocks it could not
        complete): it holds none and has computed nothing."""
        self.release(seq)
        seq.num_computed = 0

    # -- the pass -------------------------------------------------------------------------------
    def execute(self, scheduled: Seq[tuple[RunnerSeq, SeqChunk]],
                on_layer_done: LayerCallback | None = None) -> torch.Tensor:
        """Run one pass: each chunk's tokens' K/V into the pool, prompt logprobs appended to
        ``seq.prompt_logprobs`` for the chunks that ask (``chunk.prompt_logits``).

        Does not count the tokens as computed (`advance` does, once the caller accepts the
        pass). Returns the ``[S, vocab]`` float32 logits of the ``need_logits`` chunks, in
        chunk order. Raises ValueError for a chunk its block table cannot hold, and whatever
        the model's forward raises (the pass is then lost for every chunk in it).
        """
        batch = ForwardBatch.build([c for _, c in scheduled], self.pool.block_size)
        threads = self.set_pass_threads(batch.input_ids.numel())
        logits = None
        if self.graphs is not None and on_layer_done is None:
            logits = self.graphs.run(batch)   # None: not a decode step its graphs cover
        if logits is None:
            if self.borrowing is None or batch.input_ids.numel() < self.parallel_min_tokens:
                logits = self.model.forward(batch, self.pool, on_layer_done=on_layer_done)
            else:
                self._borrow(threads)
                try:
                    logits = self.model.forward(batch, self.pool,
                                                on_layer_done=self._while_lent(threads, on_layer_done))
                finally:
                    self.borrowing.give_back()
                    torch.set_num_threads(threads)
        for (seq, chunk), (first, rows) in zip(scheduled, batch.logits_spans):
            if chunk.prompt_logits:
                seq.prompt_logprobs += prompt_logprobs_of(logits[first:first + rows], seq.prompt_token_ids,
                                                          chunk.start, seq.params.prompt_logprobs)
        return batch.sampling_logits(logits)

    def _borrow(self, threads: int) -> None:
        """Add a thread on each lent CPU idle now (none idle: nothing changes)."""
        borrowed = self.borrowing.take()
        if borrowed:
            torch.set_num_threads(threads + borrowed)

    def _while_lent(self, threads: int, on_layer_done: LayerCallback | None) -> LayerCallback:
        """A long pass's layer callback with lending: once an owner wants its CPU back, the next
        layers run on the pass's own ``threads``; once a lent CPU is idle again (its owner's work
        done mid-pass), the next layers borrow it."""
        def after_layer(layer: int) -> None:
            if torch.get_num_threads() != threads:
                if self.borrowing.reclaimed():
                    self.borrowing.give_back()
                    torch.set_num_threads(threads)
            else:
                self._borrow(threads)
            if on_layer_done is not None:
                on_layer_done(layer)
        return after_layer

    def set_pass_threads(self, num_tokens: int) -> int:
        """Set torch's thread count for a pass of ``num_tokens`` tokens (``parallel_min_tokens``
        above); returns it."""
        want = self.threads if num_tokens >= self.parallel_min_tokens else 1
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        return want

    def advance(self, seq: RunnerSeq, num_tokens: int, register: bool = True) -> None:
        """Count ``num_tokens`` more of ``seq`` as computed; with prefix caching and
        ``register``, register the blocks whose positions are now all computed."""
        seq.num_computed += num_tokens
        if self.prefix_caching and register:
            self._register_full_blocks(seq)

    def _register_full_blocks(self, seq: RunnerSeq) -> None:
        bs = self.pool.block_size
        full = min(seq.num_computed // bs, len(seq.block_table))
        if full <= seq.num_registered:
            return
        if len(seq.block_hashes) < full:
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            seq.block_hashes += block_hashes(seq.all_token_ids[:full * bs], bs, start=len(seq.block_hashes),
                                             parent=parent)
        for i in range(seq.num_registered, full):
            self.pool.allocator.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered = full

    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow],
               logits_rows: Seq[int]) -> list[tuple[int | SamplingError, TokenLogprobs | None]]:
        """Draw one token for each of ``rows``, row ``i`` from ``logits[logits_rows[i]]``
        (``logits``: `execute`'s ``[S, vocab]``), with its logprobs when its params ask.
        Returns ``(token or SamplingError, TokenLogprobs or None)`` per row (`engine.sampling.
        sample`: a row that cannot be sampled fails alone)."""
        if list(logits_rows) != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(list(logits_rows), dtype=torch.long, device=logits.device))
        tokens = sample(logits, rows)
        return list(zip(tokens, compute_logprobs(logits, rows, tokens)))
