"""Attention over block tables, for prefill (several prompts, chunked) and decode batches.

A forward pass computes ``T`` new tokens belonging to ``B`` sequences. Each sequence contributes a
contiguous run of tokens at positions ``start .. start + num_tokens - 1``; earlier positions are
already in the KV pool (a previous chunk, or blocks written by a remote prefill worker). The new
tokens' K/V are written into the pool first, then every query attends to positions ``<= its own``.

Two paths:
- decode (a sequence adds exactly one token): K/V of all such sequences are gathered from the pool
  through a padded ``[B, max_blocks]`` block table and attended in one batched SDPA call, with a
  mask hiding positions past each sequence's length.
- prefill: per sequence, causal SDPA over the fresh K/V when the sequence has no earlier context,
  otherwise over the K/V gathered from the pool with an offset causal mask.
A mixed pass (prompt chunks beside decoding sequences, `engine.generator`) runs its one-token
sequences through the batched decode path and the others per sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from engine.ids import BlockId


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a forward pass.

    Attributes:
        token_ids: the new tokens (length ``num_tokens`` >= 1).
        start: position of the first new token (= tokens already in the pool).
        block_table: blocks covering at least ``start + num_tokens`` positions.
        need_logits: compute logits for the last new token (to sample the next one).
        prompt_logits: compute logits for every new token (prompt logprobs); the last one is
            still the sampling row when ``need_logits``.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[BlockId]
    need_logits: bool = True
    prompt_logits: bool = False


@dataclass
class ForwardBatch:
    """Tensors describing one forward pass (built once, shared by every layer).

    Attributes:
        input_ids: ``[T]`` int64.
        positions: ``[T]`` int64.
        slot_mapping: ``[T]`` int64, flat pool slot of each new token.
        logits_indices: ``[N]`` int64, rows of the hidden state to turn into logits.
        is_decode: every sequence adds exactly one token.
        seq_ranges: ``(first_row, num_tokens, context_len, block_ids)`` per sequence.
        block_tables: ``[D, max_blocks]`` int64 (padded with block 0), the D one-token sequences.
        decode_lens: the D one-token sequences' contexts (tokens), the new token included.
        decode_lens_t: ``decode_lens`` as a ``[D]`` int32 tensor on the device, set by `to` off
            the CPU (read by the Triton decode kernel).
        decode_groups: the D one-token sequences split into runs of rows that decode attention
            handles together (see `DecodeGroup`).
        decode_rows: mixed passes only: ``[D]`` int64, the rows of the one-token sequences
            (None when there are none, or when every sequence is one: then all rows, in order).
        sample_rows: ``[S]`` int64, the logits rows of the ``need_logits`` chunks, in chunk order;
            None when those are all the rows (no chunk asked for ``prompt_logits``).
        logits_spans: per chunk, ``(first logits row, rows)``.
        prefill_pad: ``(longest, index)`` when the pass's prompts attend as one padded batch
            (`plan_padded_prefill`; set by `to` off the CPU), else None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
    seq_ranges: list[tuple[int, int, int, torch.Tensor]]
    block_tables: torch.Tensor | None = None
    decode_lens: list[int] | None = None
    decode_groups: list["DecodeGroup"] | None = None
    decode_rows: torch.Tensor | None = None
    sample_rows: torch.Tensor | None = None
    logits_spans: list[tuple[int, int]] | None = None
    decode_lens_t: torch.Tensor | None = None
    prefill_pad: tuple[int, torch.Tensor | None] | None = None
    _decode_biases: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    _indexed_inputs: tuple | None = dataclasses.field(default=None, init=False, repr=False)
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def memo(self, key, build):
        """``build()``, called once per batch and ``key`` (a kernel's per-batch inputs, shared by
        every layer)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def indexed_decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables, lens)`` of the one-token sequences for `CompiledDecode`, at least two
        columns (a lone column followed by a copy of itself: positions past a row's context are
        masked), ``[R, W]`` and ``[R]`` int64 on the tables' device. Built once per batch and
        reused by every layer."""
        if self._indexed_inputs is None:
            tables = self.block_tables
            lens = torch.tensor(self.decode_lens, dtype=torch.long, device=tables.device)
            if tables.shape[1] == 1:
                tables = torch.cat([tables, tables], dim=1)
            # always new tensors, made here: under a model's inference mode all of them are
            # inference tensors, so padded and unpadded batches meet the same guards (one graph)
            self._indexed_inputs = (tables.clone(memory_format=torch.contiguous_format),
                                    lens.clone(memory_format=torch.contiguous_format))
        return self._indexed_inputs

    def decode_bias(self, group: "DecodeGroup", window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``group``'s attention bias in ``dtype``: ``[rows, 1, 1, span]``, -inf past each row's
        context and, with ``window``, before its last ``window`` positions; None when nothing is
        hidden. Built once per batch and reused by every layer."""
        key = (group.lo, window, dtype)
        if key not in self._decode_biases:
            bias = group.bias if group.bias is None else group.bias.to(dtype)
            if window is not None and group.span > window:
                n, dev = group.hi - group.lo, group.blocks.device
                lens = torch.tensor(self.decode_lens[group.lo:group.hi], device=dev)
                before = torch.arange(group.span, device=dev)[None, :] < (lens - window)[:, None]
                hide = torch.zeros(n, 1, 1, group.span, dtype=dtype, device=dev).masked_fill_(
                    before.view(n, 1, 1, group.span), float("-inf"))
                bias = hide if bias is None else bias + hide
            self._decode_biases[key] = bias
        return self._decode_biases[key]

    def sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The ``[S, vocab]`` rows of ``logits`` (the model's output) to sample from."""
        return logits if self.sample_rows is None else logits.index_select(0, self.sample_rows.to(logits.device))

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], block_size: int) -> "ForwardBatch":
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        ranges = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            end = chunk.start + n
            if n < 1 or len(chunk.block_table) * block_size < end:
                raise ValueError(f"chunk of {n} tokens at {chunk.start} does not fit its block table")
            first = len(ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, end))
            table = chunk.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(chunk.start, end))
            span_start = len(logits_rows)
            if chunk.prompt_logits:
                logits_rows.extend(range(first, len(ids)))
            elif chunk.need_logits:
                logits_rows.append(len(ids) - 1)
            if chunk.need_logits:
                sample_rows.append(len(logits_rows) - 1)
            spans.append((span_start, len(logits_rows) - span_start))
            nblocks = -(-end // block_size)
            ranges.append((first, n, end, torch.tensor(list(table[:nblocks]), dtype=torch.long)))
        batch = cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long),
            is_decode=all(len(c.token_ids) == 1 for c in chunks),
            seq_ranges=ranges,
            logits_spans=spans,
        )
        if len(sample_rows) != len(logits_rows):
            batch.sample_rows = torch.tensor(sample_rows, dtype=torch.long)
        singles = [i for i, r in enumerate(ranges) if r[1] == 1]
        if len(singles) == len(ranges):
            batch._build_decode_tables(block_size, ranges)
        elif len(singles) > 1:   # one alone is as cheap through the per-sequence path
            batch._build_decode_tables(block_size, [ranges[i] for i in singles])
            batch.decode_rows = torch.tensor([ranges[i][0] for i in singles], dtype=torch.long)
        return batch

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """``[D, 1, 1, max(decode_lens)]`` bool, True = attend: the decode rows' mask over their
        contexts, built on demand (decode attention itself uses `decode_groups`); None without
        decode rows."""
        if self.decode_lens is None:
            return None
        span = torch.arange(max(self.decode_lens))
        lens = torch.tensor(self.decode_lens)
        return (span[None, :] < lens[:, None])[:, None, None, :]

    def to(self, device: torch.device) -> "ForwardBatch":
        """A copy with every tensor on ``device`` (the model's); off the CPU, the decode rows
        form one `DecodeGroup` (grouping keeps K/V in a CPU core's cache)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        groups = self.decode_groups
        if groups is not None and torch.device(device).type != "cpu":
            groups = DecodeGroup.plan(self.block_tables, self.decode_lens, None)
        return dataclasses.replace(
            self, input_ids=move(self.input_ids), positions=move(self.positions),
            slot_mapping=move(self.slot_mapping), logits_indices=move(self.logits_indices),
            seq_ranges=[(a, b, c, move(d)) for a, b, c, d in self.seq_ranges],
            block_tables=move(self.block_tables),
            decode_groups=None if groups is None else [g.to(device) for g in groups],
            decode_rows=move(self.decode_rows), sample_rows=move(self.sample_rows),
            decode_lens_t=None if self.decode_lens is None or torch.device(device).type == "cpu"
            else torch.tensor(self.decode_lens, dtype=torch.int32, device=device),
            # one padded SDPA call instead of one per prompt: off the CPU, where a call's launch
            # costs more than the padded rows' arithmetic
            prefill_pad=None if torch.device(device).type == "cpu" else self.plan_padded_prefill(device))

    def plan_padded_prefill(self, device: torch.device | str = "cpu") -> tuple[int, torch.Tensor | None] | None:
        """``(L, index)`` for a pass of two or more prompts that attend to themselves alone (each
        chunk is its sequence's start: no cached context, no one-token rows): prefill attention
        then runs as one causal SDPA over a ``[S, heads, L, head_dim]`` batch right-padded to the
        longest prompt ``L`` instead of one call per sequence (the padded keys sit after every
        real query, so the causal mask alone hides them). ``index``: ``[T]`` int64 on ``device``,
        row ``t``'s place in the flattened ``[S * L]`` padded rows, or None when every prompt is
        ``L`` long (the rows are that batch already: no padding, no copies). None when the pass is
        not such a batch, or when padding would more than double the rows attended."""
        if self.is_decode or self.decode_rows is not None or len(self.seq_ranges) < 2:
            return None
        if any(ctx != n for _, n, ctx, _ in self.seq_ranges):
            return None
        longest = max(n for _, n, _, _ in self.seq_ranges)
        total = sum(n for _, n, _, _ in self.seq_ranges)
        if longest * len(self.seq_ranges) > 2 * total:
            return None
        if total == longest * len(self.seq_ranges) and all(
                first == i * longest for i, (first, _, _, _) in enumerate(self.seq_ranges)):
            return longest, None
        index = torch.cat([torch.arange(n) + i * longest for i, (_, n, _, _) in enumerate(self.seq_ranges)])
        return longest, index.to(device)

    def _build_decode_tables(self, block_size: int, ranges) -> None:
        max_blocks = max(r[3].numel() for r in ranges)
        tables = torch.zeros((len(ranges), max_blocks), dtype=torch.long)
        lens = torch.empty(len(ranges), dtype=torch.long)
        for i, (_, _, ctx, blocks) in enumerate(ranges):
            tables[i, : blocks.numel()] = blocks
            lens[i] = ctx
        self.block_tables = tables
        self.decode_lens = lens.tolist()
        self.decode_groups = DecodeGroup.plan(tables, self.decode_lens, DECODE_GROUP_TOKENS)


DECODE_GROUP_TOKENS = 1024
"""Context positions (summed over a group's rows, each counted at the group's longest context)
that CPU decode attention gathers and attends at once. A group's float32 K/V then take
``1024 * 2 * num_kv_heads * head_dim * 4`` bytes (1.5 MiB for SmolLM2-135M), about one core's
L2: gathering a whole batch of 32 sequences of ~400 tokens at once instead wrote 20 MB per layer
that the attention then read back from memory (see `_decode_attention` for the measurement)."""


@dataclass(frozen=True)
class DecodeGroup:
    """Rows ``lo .. hi - 1`` of a decode batch, attended together.

    Attributes:
        span: the longest context among them (tokens): the positions gathered per row.
        blocks: ``[(hi - lo) * max_blocks]`` int64, their block tables, flattened.
        bias: ``[hi - lo, 1, 1, span]`` float32, 0 where a position is attended and -inf past a
            row's context; None when every row's context is ``span`` (nothing to mask).
    """

    lo: int
    hi: int
    span: int
    blocks: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def plan(cls, tables: torch.Tensor, lens: list[int], budget_tokens: int | None) -> list["DecodeGroup"]:
        """Split rows in order into groups of at most ``budget_tokens`` gathered positions
        (rows x the group's longest context; a row longer than the budget is a group alone;
        None: one group).

        Args:
            tables: ``[D, max_blocks]`` int64 block tables; lens: the D contexts (tokens).
        """
        groups, lo = [], 0
        while lo < len(lens):
            hi, span = lo + 1, lens[lo]
            while hi < len(lens) and (budget_tokens is None
                                      or (hi + 1 - lo) * max(span, lens[hi]) <= budget_tokens):
                span = max(span, lens[hi])
                hi += 1
            rows = torch.tensor(lens[lo:hi])
            bias = None
            if int(rows.min()) != span:
                past = (torch.arange(span)[None, :] >= rows[:, None]).view(hi - lo, 1, 1, span)
                bias = torch.zeros(hi - lo, 1, 1, span).masked_fill_(past, float("-inf"))
            groups.append(cls(lo, hi, span, tables[lo:hi].reshape(-1), bias))
            lo = hi
        return groups

    def to(self, device: torch.device) -> "DecodeGroup":
        """A copy with its tensors on ``device``."""
        bias = None if self.bias is None else self.bias.to(device, non_blocking=True)
        return DecodeGroup(self.lo, self.hi, self.span, self.blocks.to(device, non_blocking=True), bias)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
                    block_size: int, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None, decode_kernel: "engine.paged_decode.CompiledDecode | None" = None,
                    prefill_kernel: "engine.flex_prefill.CompiledPrefill | None" = None,
                    prefill_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention of the new tokens, after their K/V have been written into the pool.

    Args:
        q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]`` (the new tokens,
            in the pool's dtype).
        k_pool, v_pool: one layer's pool, ``[num_blocks, num_kv_heads, block_size, head_dim]``.
            K/V of another dtype than ``q``'s (a bfloat16 pool, float32 attention) are cast to it
            after the gather.
        window: sliding-window attention: the query at position ``p`` attends to positions
            ``p - window + 1 .. p`` only (Hugging Face's ``kv_idx > q_idx - sliding_window``);
            None: to every earlier position.
        scale: the scores' scale; None: ``head_dim ** -0.5``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's
            ``attn_logit_softcapping``, Hugging Face ``modeling_gemma2.eager_attention_forward``);
            computed eagerly, since SDPA has no such hook.
        decode_kernel: on the CPU, the one-token sequences' attention through this `CompiledDecode`
            (`engine.paged_decode`) instead of the grouped path when they are at least its ``min_rows``
            (``--attention-backend compiled``).
        prefill_kernel: on the CPU, a prompt chunk's attention (to itself and, past cached
            context, to the pool's K/V before it, gathered) through this `CompiledPrefill`
            instead of SDPA when it `takes` the chunk's length, outside sliding windows and
            soft-capping (``--attention-backend compiled``).
        prefill_dtype: on the CPU, the prompt chunks' SDPA (not ``prefill_kernel``'s, nor the
            one-token sequences', nor soft-capped scores) computed in this dtype, ``q`` and the
            K/V cast to it and the output cast back to ``q``'s (bfloat16 where oneDNN's AMX
            kernels make it faster than float32, `engine.prefill_choice`); None: in ``q``'s.
    Returns:
        ``[T, num_heads * head_dim]`` in ``q``'s dtype.
    """
    if batch.is_decode:
        return _decode_attention(q, k_pool, v_pool, batch, block_size, window, scale, softcap, decode_kernel)
    low = q.dtype if prefill_dtype is None or softcap is not None or q.device.type != "cpu" else prefill_dtype
    pad = batch.prefill_pad
    if pad is not None and softcap is None and (window is None or pad[0] <= window):
        return _padded_prefill(q, k, v, pad, len(batch.seq_ranges), scale)   # off the CPU: in q's dtype
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    if batch.decode_rows is not None:
        out[batch.decode_rows] = _decode_attention(q.index_select(0, batch.decode_rows), k_pool, v_pool,
                                                   batch, block_size, window, scale, softcap, decode_kernel)
    for first, n, ctx, blocks in batch.seq_ranges:
        if n == 1 and batch.decode_rows is not None:
            continue   # done above
        windowed = window is not None and ctx > window
        if ctx == n:
            ks, vs = k[first:first + n], v[first:first + n]
        else:
            ks, vs = _gather(k_pool, blocks, block_size, ctx), _gather(v_pool, blocks, block_size, ctx)
        if not windowed and softcap is None and prefill_kernel is not None and prefill_kernel.takes(n):
            out[first:first + n] = prefill_kernel(q[first:first + n], ks, vs, scale)   # it casts K/V
            continue
        dtype = low if n > 1 else q.dtype   # a one-token sequence attends as in a decode pass
        qs = q[first:first + n].to(dtype).transpose(0, 1).unsqueeze(0)
        ks = ks.to(dtype).transpose(0, 1).unsqueeze(0)
        vs = vs.to(dtype).transpose(0, 1).unsqueeze(0)
        if ctx == n and not windowed and softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, scale=scale)
        elif not windowed and softcap is None and q.device.type == "cpu":
            o = causal_after_context(qs, ks, vs, scale)
        else:
            rows = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            cols = torch.arange(ctx, device=q.device)[None, :]
            mask = cols <= rows
            if windowed:
                mask &= cols > rows - window
            o = _attend(qs, ks, vs, mask, scale, softcap)
        out[first:first + n] = o.squeeze(0).transpose(0, 1).reshape(n, -1)   # cast back to q's dtype
    return out


def _padded_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: tuple[int, torch.Tensor], seqs: int,
                    scale: float | None) -> torch.Tensor:
    """`paged_attention` of a pass of ``seqs`` whole prompts as one causal SDPA over their rows
    right-padded to ``pad = (L, index)`` (`ForwardBatch.plan_padded_prefill`); padded rows are
    zeros and are dropped. Returns ``[T, heads * head_dim]`` in ``q``'s dtype."""
    longest, index = pad
    rows, heads, dim = q.shape

    def padded(x: torch.Tensor) -> torch.Tensor:
        if index is None:   # prompts of one length: the rows are the batch already
            return x.to(q.dtype).view(seqs, longest, x.shape[1], dim).transpose(1, 2)
        out = x.new_zeros((seqs * longest, x.shape[1], dim), dtype=q.dtype)
        out.index_copy_(0, index, x.to(q.dtype))
        return out.view(seqs, longest, x.shape[1], dim).transpose(1, 2)

    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, enable_gqa=True, scale=scale)
    o = o.transpose(1, 2).reshape(seqs * longest, heads * dim)
    return o if index is None else o.index_select(0, index)


def store_kv(pool: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    """Write ``x`` ``[T, num_kv_heads, head_dim]`` (the new tokens' K or V) into one layer's
    ``pool`` ``[num_blocks, num_kv_heads, block_size, head_dim]`` at ``slots``: ``(blocks,
    offsets)``, each ``[T]`` int64 (`ForwardBatch.slot_mapping` split by the block size)."""
    pool.transpose(1, 2).index_put_(slots, x)


def _gather(pool: torch.Tensor, blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """A sequence's first ``length`` positions of ``pool`` (``[num_blocks, kv_heads, block_size,
    dim]``) through its ``blocks``, as ``[length, kv_heads, dim]`` (a view of one gathered copy)."""
    per_block = pool.transpose(0, 1).index_select(1, blocks[:-(-length // block_size)])
    return per_block.view(pool.shape[1], -1, pool.shape[3])[:, :length].transpose(0, 1)


def causal_after_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of ``q`` ``[1, heads, n, d]``, the last ``n`` of ``ctx`` positions, over
    ``k``, ``v`` ``[1, kv_heads, ctx, d]`` (query head ``h`` reads KV head ``h // (heads /
    kv_heads)``), on the CPU: the cached context's ``ctx - n`` keys, all visible, and the chunk's
    own ``n`` under the causal mask. A context of at most a quarter of the chunk (a chat
    template's cached prefix): one causal call of torch's flash kernel over ``q`` padded at the
    front with ``ctx - n`` zero rows (its top-left causal mask then puts query ``i`` at position
    ``ctx - n + i``), their outputs dropped. A longer one: two calls, the context unmasked and the
    chunk causal, merged by their log-sum-exps (FlashInfer's and vLLM's ``merge_attn_states``).
    An explicit ``[n, ctx]`` mask would compute the masked triangle too; a causal call skips its
    blocks (docs/PERFORMANCE.md, "A short cached context before a prompt chunk"). Returns ``[1,
    heads, n, d]`` in ``q``'s dtype."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past = k.shape[2] - q.shape[2]
    if past * 4 <= q.shape[2]:
        padded = q.new_zeros(q.shape[0], q.shape[1], k.shape[2], q.shape[3])
        padded[:, :, past:] = q
        return flash(padded, k, v, 0.0, True, scale=scale)[0][:, :, past:]
    o_ctx, lse_ctx = flash(q, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)
    o_own, lse_own = flash(q, k[:, :, past:], v[:, :, past:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_ctx, lse_own)
    return (o_ctx * torch.exp(lse_ctx - lse)[..., None] + o_own * torch.exp(lse_own - lse)[..., None]).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float | None, softcap: float | None) -> torch.Tensor:
    """SDPA of ``q`` ``[..., heads, n, d]`` over ``k``, ``v`` ``[..., kv_heads, ctx, d]`` (query
    head ``h`` reads KV head ``h // (heads / kv_heads)``), ``mask`` a boolean keep-mask or an
    additive bias broadcasting to ``[..., heads, n, ctx]``. With ``softcap``, eagerly: scores
    capped (``softcap * tanh(s / softcap)``), masked, softmax in float32 (as Hugging Face's
    eager attention), and K/V repeated per query head (its ``repeat_kv``)."""
    groups = q.shape[-3] // k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1, scale=scale)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _decode_attention(q, k_pool, v_pool, batch: ForwardBatch, block_size: int,
                      window: int | None = None, scale: float | None = None,
                      softcap: float | None = None, kernel: "engine.paged_decode.CompiledDecode | None" = None) -> torch.Tensor:
    """One query per sequence, over its gathered K/V (``q``: ``[D, num_heads, head_dim]``;
    returns ``[D, num_heads * head_dim]``); with ``window``, over its last ``window`` positions.

    On CUDA with Triton: `engine.triton_attention.paged_decode`, straight from the pool through the
    block table. On the CPU with ``kernel``: `engine.paged_decode.CompiledDecode`, likewise. Otherwise:
    the G = num_heads / num_kv_heads query heads sharing a KV head (grouped-query attention; Hugging
    Face's ``repeat_kv`` maps query head ``h`` to KV head ``h // G``) attend as G query rows of
    that KV head, so K/V are never expanded. Per `DecodeGroup` (on the CPU; one group on other
    devices, `ForwardBatch.to`), the gathered K/V are cast to ``q``'s dtype and laid out
    ``[rows, num_kv_heads, span, head_dim]`` in one copy each, read only up to the group's longest
    context, and attended while they are still in cache (measured against gathering the whole
    batch at once: docs/PERFORMANCE.md, "Grouped decode attention").
    """
    b, heads, dim = q.shape
    if kernel is not None and q.device.type == "cpu" and b >= kernel.min_rows:
        return kernel(q, k_pool, v_pool, batch, window, scale, softcap)
    if batch.decode_lens_t is not None:   # set off the CPU (`ForwardBatch.to`)
        from engine import triton_attention

        if triton_attention.available(q.device):   # off the CPU: read the pool through the block table
            return triton_attention.paged_decode(q, k_pool, v_pool, batch.block_tables, batch.decode_lens_t,
                                                 block_size, window, scale, softcap).reshape(b, -1)
    kv_heads = k_pool.shape[1]
    q = q.view(b, kv_heads, heads // kv_heads, dim)
    outs = []
    for g in batch.decode_groups:
        n = g.hi - g.lo

        def gather(pool: torch.Tensor) -> torch.Tensor:
            per_block = pool.transpose(0, 1).index_select(1, g.blocks)   # [kv_heads, n * blocks, block_size, dim]
            src = per_block.view(kv_heads, n, -1, dim)[:, :, :g.span]
            out = torch.empty(n, kv_heads, g.span, dim, dtype=q.dtype, device=q.device)
            return out.copy_(src.transpose(0, 1))

        bias = batch.decode_bias(g, window, q.dtype)
        o = _attend(q[g.lo:g.hi], gather(k_pool), gather(v_pool), bias, scale, softcap)
        outs.append(o.reshape(n, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
