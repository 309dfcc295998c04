"""Decode attention that reads the KV pool through the block table on the CPU: `paged_decode_indexed`
(torch indexing over the pool) and `CompiledDecode` (it compiled ahead of time by AOTInductor), the kernel of
``--attention-backend compiled|auto``; `engine.attention._decode_attention` dispatches to it.
Measured against the grouped path: docs/PERFORMANCE.md, "Decode attention through the block table"."""

from __future__ import annotations

import statistics
import time

import torch

from engine.aot_kernel import AotPackage, package_for
from engine.attention import ForwardBatch, SeqChunk, paged_attention

MAX_LENGTH_GROUPS = 3
"""Most calls a decode step's attention is split into by context length (`length_groups`)."""
MAX_FUSED_GROUPS = 8
"""`paged_decode_indexed` computes the scores of up to this many query heads per KV head as
separate reductions fused into one loop (each key read once for all of them); more heads share
one reduction (a loop per head reading the key again), which measured as fast there with less
generated code (docs/PERFORMANCE.md, "Decode attention: a KV head's query heads in one loop")."""
VALUE_CHUNK = 32
"""Head-dimension elements per value reduction of `paged_decode_indexed` (one 512-bit load of
bfloat16): the output's head dimension is split into reductions of this many, so the fused loop
reads each value row whole per key; a single reduction over the head dimension is looped over by
inductor a vector at a time, each pass reading every value row again."""
MAX_VALUE_REDUCTIONS = 16
"""Most separate value reductions (query heads per KV head x head-dimension chunks) one fused loop
of `paged_decode_indexed` holds; fewer chunks above it, where the accumulators no longer fit the
vector registers (docs/PERFORMANCE.md, "Decode attention: value rows read whole")."""
MIN_PADDING_SAVED = 0.15
"""`length_groups` splits only when that leaves at most ``1 - this`` of the padded blocks."""


def paged_decode_indexed(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor, window: int | None = None,
                         scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Decode attention written as torch indexing of the pool through the block table: no
    gathered copy of any sequence's K/V is built when inductor compiles it (``torch.compile``
    fuses the indexing into the score and output reductions); eagerly it is a slow reference.
    Whole blocks are indexed (``pool[block_tables]``), so the generated loops read one table entry
    per block and the block's positions contiguously; the scores of a KV head's query heads are
    separate reductions, which inductor fuses into one loop reading each key once for all of
    them, and so are their value sums, per head and `value_chunks` piece of the head dimension,
    fused into one loop reading each value row whole once (up to `MAX_FUSED_GROUPS` heads per KV
    head); the scale multiplies the scores, and the softmax is normalised after the value
    reduction (the same sum, divided once per output).
    The CPU decode kernel of ``--attention-backend compiled`` (`CompiledDecode`; measured against
    the grouped path: ``python -m bench.decode_attention``, docs/PERFORMANCE.md "Decode attention
    through the block table").

    Args:
        q: ``[D, num_heads, head_dim]`` float, one query per sequence.
        k_pool, v_pool: one layer's pool, ``[num_blocks, num_kv_heads, block_size, head_dim]``
            (any float dtype; cast to ``q``'s inside the reductions).
        block_tables: ``[D, max_blocks]`` int64; entries past a sequence's blocks may be any
            valid block (they are masked).
        lens: ``[D]`` int64, each sequence's context (tokens, the new one included), at most
            ``max_blocks * block_size``.
        window, scale, softcap: as `paged_attention` (query head ``h`` reads KV head
            ``h // (num_heads / num_kv_heads)``, Hugging Face's ``repeat_kv``).
    Returns:
        ``[D, num_heads * head_dim]`` in ``q``'s dtype.
    """
    d, heads, dim = q.shape
    kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
    width, groups = block_tables.shape[1], heads // kv_heads
    qg = q.view(d, 1, kv_heads, groups, 1, dim)
    # whole blocks through the table: one index per block, the positions inside it contiguous
    k = k_pool[block_tables].to(q.dtype)                              # [D, W, kv_heads, block, dim]
    # one reduction per query head of the group: inductor fuses them into one loop that loads
    # each key once for the group's heads, where one [.., G, ..] reduction loads it once per head;
    # the scale multiplies each score, not each of its head_dim products
    if groups <= MAX_FUSED_GROUPS:
        s = torch.stack([(qg[:, :, :, g] * k).sum(-1) for g in range(groups)], 3)   # [D, W, kv_heads, G, block]
    else:
        s = (qg * k[:, :, :, None]).sum(-1)
    s = s * (dim ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = (torch.arange(width, device=q.device)[:, None] * block_size
           + torch.arange(block_size, device=q.device)[None, :])      # [W, block]
    hidden = pos[None] >= lens[:, None, None]                         # [D, W, block]
    if window is not None:
        hidden = hidden | (pos[None] < (lens - window)[:, None, None])
    s = s.masked_fill(hidden[:, :, None, None, :], float("-inf"))
    e = torch.exp(s - s.amax(dim=(1, 4), keepdim=True))             # softmax over (W, block), normalised last
    v = v_pool[block_tables].to(q.dtype)                              # [D, W, kv_heads, block, dim]
    if groups <= MAX_FUSED_GROUPS:
        # one reduction per (query head, head-dimension chunk), fused into one loop over the keys
        # that reads each value row whole (one per head and chunk, the head dimension vectorised)
        chunks = value_chunks(groups, dim)
        part = dim // chunks
        out = torch.stack([torch.cat([(e[:, :, :, g, :, None] * v[..., c * part:(c + 1) * part]).sum(dim=(1, 3))
                                      for c in range(chunks)], -1) for g in range(groups)], 2)
    else:
        out = (e[..., None] * v[:, :, :, None]).sum(dim=(1, 4))      # [D, kv_heads, G, dim]
    out = out / e.sum(dim=(1, 4)).view(d, kv_heads, groups, 1)
    return out.reshape(d, heads * dim)


def value_chunks(groups: int, head_dim: int) -> int:
    """How many head-dimension chunks `paged_decode_indexed` splits each query head's value
    reduction into: ``head_dim // VALUE_CHUNK`` (at least one), fewer while they do not divide
    ``head_dim`` or ``groups`` times them exceeds `MAX_VALUE_REDUCTIONS`.

    Args:
        groups: query heads per KV head; head_dim: elements per head.
    Returns:
        The chunk count, at least 1, dividing ``head_dim``; raises nothing.
    """
    chunks = max(1, head_dim // VALUE_CHUNK)
    while chunks > 1 and (head_dim % chunks or groups * chunks > MAX_VALUE_REDUCTIONS):
        chunks -= 1
    return chunks


def length_groups(tables: torch.Tensor, lens: torch.Tensor,
                  block_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """The rows of a decode batch in up to `MAX_LENGTH_GROUPS` groups of similar context length,
    each with its own block-table width, or None when one call serves it as well. The compiled
    kernel computes every row over the table's whole width (positions past a row's context are
    masked, not skipped), so rows of 150 and 450 tokens in one call both cost 450; in groups, each
    costs about its group's longest (measured: docs/PERFORMANCE.md, "Decode attention in groups
    of similar length").

    Args:
        tables: ``[R, W]`` int64, lens: ``[R]`` int64 (`ForwardBatch.indexed_decode_inputs`).
        block_size: tokens per block.
    Returns:
        ``[(rows, tables[rows, :w], lens[rows]), ...]``: ``rows`` int64 indices in ascending
        context length, every row in exactly one group, each group of two rows or more and
        ``w >= 2`` columns; None when the batch has fewer than 4 rows or the groups would still
        compute more than ``1 - MIN_PADDING_SAVED`` of the one call's padded blocks.
    """
    rows = lens.shape[0]
    if rows < 4:
        return None
    blocks = (lens + block_size - 1) // block_size
    order = torch.argsort(lens, stable=True)
    parts = torch.tensor_split(order, min(MAX_LENGTH_GROUPS, rows // 2))
    widths = [max(2, int(blocks[p].max())) for p in parts]
    if sum(len(p) * w for p, w in zip(parts, widths)) > (1 - MIN_PADDING_SAVED) * rows * tables.shape[1]:
        return None
    return [(p, tables[p, :w].contiguous(), lens[p].contiguous()) for p, w in zip(parts, widths)]


class CompiledDecode:
    """`paged_decode_indexed` compiled ahead of time by AOTInductor (`engine.aot_kernel`): the CPU
    decode-attention kernel of a worker started with ``--attention-backend compiled`` (or
    ``auto``); K/V are read from the pool through the block table, never gathered into a copy
    (measured against the grouped path: docs/PERFORMANCE.md, "Decode attention through the block
    table").

    One package serves every decode batch of one pool layout: the batch size (one and more) and
    the block table's width (two and more: a table of one column is padded to two,
    `engine.attention.ForwardBatch.indexed_decode_inputs`) are dynamic. A package is built for one
    thread count (inductor writes its parallel loops for it), one pool dtype, KV heads, block size
    and head dimension (any block count where the pool is a view of head-major storage, as
    `engine.kv_cache.KVPool` holds it: `head_major`; one shape and stride otherwise), one
    query dtype and head shape, window, scale and soft-cap; the kernel keeps one per such key,
    loaded from the disk cache or built at the first call that needs it (a model's ``warm_up``
    makes that call before the first request; a worker warms each thread count its passes may
    take, `worker.kernels`; measured: docs/PERFORMANCE.md, "Decode attention on the pass's
    threads, and where a served core goes"). ``packages`` holds them, by key.

    Raises (from the call that builds a package): ``torch.export`` / ``torch._inductor`` errors
    when inductor cannot build CPU code (no C++ compiler); `worker.kernels` turns that into a
    refusal to start.
    """

    min_rows = 4
    """Default of ``min_rows`` (`__init__`), until `measure_min_rows` sets it."""

    def __init__(self, min_rows: int = min_rows):
        """``min_rows``: decode batches of fewer one-token sequences keep the grouped path, where
        this kernel's fixed cost per call outweighs its gain; whether it does depends on the CPU,
        so a worker times both at start-up (`measure_min_rows`; measured: docs/PERFORMANCE.md,
        "Decode attention through the block table" and "Decode attention on one row, timed at
        start-up")."""
        self.min_rows = min_rows
        self.packages: dict[tuple, AotPackage] = {}

    def package(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, window: int | None,
                scale: float | None, softcap: float | None) -> AotPackage:
        """The package for these operands (``q`` ``[D, heads, head_dim]``, one layer's pools) on
        the current thread count: kept, loaded or built (`engine.aot_kernel.package_for`). For
        pools that are views of head-major storage (`head_major`) the key holds no block count:
        one package serves every pool size; other layouts are keyed by their shape and strides."""
        dynamic = head_major(k_pool, v_pool)
        if dynamic:
            key = (q.dtype, q.shape[1:], k_pool.dtype, "head-major", k_pool.shape[1:], window, scale, softcap)
        else:
            key = (q.dtype, q.shape[1:], k_pool.dtype, k_pool.shape, k_pool.stride(), v_pool.stride(), window,
                   scale, softcap)
        return package_for(self.packages, "paged_decode", key, [__file__],
                           lambda: _export_decode(q, k_pool, v_pool, window, scale, softcap, dynamic))

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
                 window: int | None, scale: float | None, softcap: float | None) -> torch.Tensor:
        """``q`` ``[D, heads, head_dim]`` (the batch's one-token sequences, in `ForwardBatch`
        order) over one layer's pool -> ``[D, heads * head_dim]`` in ``q``'s dtype. On one
        thread, one call of the package per group of `length_groups` (computed once per batch);
        on more, one call: a call per group adds a barrier of the threads each and splits the
        rows they share, and measured no faster (docs/PERFORMANCE.md, "Decode attention in
        groups of similar length")."""
        tables, lens = batch.indexed_decode_inputs()
        rows = q.shape[0]
        q = q.contiguous()
        package = self.package(q, k_pool, v_pool, window, scale, softcap)
        groups = None if torch.get_num_threads() > 1 else batch.memo(
            ("length_groups", k_pool.shape[2]), lambda: length_groups(tables, lens, k_pool.shape[2]))
        if groups is None:
            return package(q, k_pool, v_pool, tables, lens)[0][:rows]
        out = q.new_empty(rows, q.shape[1] * q.shape[2])
        for index, group_tables, group_lens in groups:
            out.index_copy_(0, index, package(q.index_select(0, index), k_pool, v_pool, group_tables, group_lens)[0])
        return out


def head_major(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether one layer's pools (``[num_blocks, num_kv_heads, block_size, head_dim]``) are views
    of head-major storage, contiguous as ``[num_kv_heads, num_blocks, block_size, head_dim]`` (as
    `engine.kv_cache.KVPool.layer_view` gives them), of two or more blocks: their strides then
    follow from the block count, which a `CompiledDecode` package takes as dynamic. Read from
    the shapes and strides alone (no tensor is made: it runs per layer and step). Raises
    ValueError for a ``k_pool`` that is not 4-D."""
    blocks, heads, block_size, head_dim = k_pool.shape
    want = (block_size * head_dim, blocks * block_size * head_dim, head_dim, 1)
    return (blocks >= 2 and v_pool.shape == k_pool.shape and k_pool.stride() == want
            and v_pool.stride() == want)


class _Decode(torch.nn.Module):
    """`paged_decode_indexed` with its static parameters fixed, as `torch.export` takes it."""

    def __init__(self, window: int | None, scale: float | None, softcap: float | None):
        super().__init__()
        self.window, self.scale, self.softcap = window, scale, softcap

    def forward(self, q, k_pool, v_pool, block_tables, lens):
        return paged_decode_indexed(q, k_pool, v_pool, block_tables, lens, self.window, self.scale, self.softcap)


EXPORT_BLOCKS = 17
"""Blocks of the example pools a head-major package is exported on (any count from two is
served): a prime unlike the example's rows (5) and table width (7), so no size of the example
equals another by chance and gets tied to it in the exported program."""


def _export_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, window: int | None,
                   scale: float | None, softcap: float | None, dynamic_blocks: bool = False):
    """`_Decode` exported on example operands shaped as ``q`` and the pools (5 rows, 7 table
    columns), rows dynamic from one up and columns from two; with ``dynamic_blocks`` (pools that
    are `head_major` views), on views of zero head-major storage of `EXPORT_BLOCKS` blocks, the
    block count dynamic from two up (the strides follow from it), else on the pools themselves
    (shape and strides static)."""
    rows, width = torch.export.Dim("rows", min=1), torch.export.Dim("width", min=2)
    example_q = torch.zeros(5, *q.shape[1:], dtype=q.dtype, device=q.device)
    tables = torch.zeros(5, 7, dtype=torch.long, device=q.device)
    lens = torch.full((5,), 7 * k_pool.shape[2], dtype=torch.long, device=q.device)
    pool_shapes = (None, None)
    if dynamic_blocks:
        k_pool, v_pool = (torch.zeros(p.shape[1], EXPORT_BLOCKS, *p.shape[2:], dtype=p.dtype,
                                      device=p.device).transpose(0, 1) for p in (k_pool, v_pool))
        blocks = torch.export.Dim("blocks", min=2)
        pool_shapes = ({0: blocks}, {0: blocks})
    return torch.export.export(_Decode(window, scale, softcap), (example_q, k_pool, v_pool, tables, lens),
                               dynamic_shapes=({0: rows}, *pool_shapes, {0: rows, 1: width}, {0: rows}))


ROW_CANDIDATES = (1, 2, 3)
"""Decode batch sizes below `CompiledDecode.min_rows` that `measure_min_rows` times."""
MEASURE_CONTEXT = 256
"""Tokens of context per sequence `measure_min_rows` times at (fewer when the pool is smaller)."""


def faster_from(times: dict[int, tuple[float, float]], default: int) -> int:
    """The ``min_rows`` that ``times`` (rows -> (kernel seconds, grouped seconds)) supports: the
    fewest rows from which the kernel was faster at every timed row count, else ``default``
    (row counts at or above ``default`` are taken as the kernel's)."""
    rows = default
    for r in sorted((r for r in times if r < default), reverse=True):
        if times[r][0] >= times[r][1]:
            break
        rows = r
    return rows


def measure_min_rows(kernel: CompiledDecode, q_shape: tuple[int, int], q_dtype: torch.dtype,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: list[int], window: int | None,
                     scale: float | None, softcap: float | None, threads_for, reps: int = 15) -> dict:
    """Time one layer's decode attention through ``kernel`` and through the grouped path for
    each of `ROW_CANDIDATES` rows, the rows sharing ``blocks`` (held by the caller; their
    contents do not matter) as a context of ``len(blocks) * block_size - 1`` tokens, the calls
    alternated, each on ``threads_for(rows)`` torch threads (the count a pass of that many
    tokens runs on); set ``kernel.min_rows`` by `faster_from` (the kernel's fixed cost per call
    against its gain depends on the CPU: docs/PERFORMANCE.md, "Decode attention on one row,
    timed at start-up"). The kernel's packages for those thread counts must be built (a model's
    ``warm_up``) or are built here.

    Args:
        q_shape: ``(num_heads, head_dim)``; q_dtype: the attention's dtype.
        k_pool, v_pool: one layer's pool ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        window, scale, softcap: that layer's (`engine.attention.paged_attention`).
    Returns:
        ``{rows: (kernel seconds, grouped seconds)}``, medians of ``reps`` calls each.
    Raises:
        ValueError: fewer than one block.
    """
    if not blocks:
        raise ValueError("measuring the decode kernel needs at least one block")
    block_size = k_pool.shape[2]
    context = len(blocks) * block_size - 1
    threads, default = torch.get_num_threads(), kernel.min_rows
    times = {}
    kernel.min_rows = 1   # the kernel takes every batch while it is timed
    try:
        for rows in ROW_CANDIDATES:
            batch = ForwardBatch.build([SeqChunk([0], context, blocks) for _ in range(rows)], block_size)
            q = torch.randn(rows, *q_shape, dtype=q_dtype)
            torch.set_num_threads(threads_for(rows))
            spent = {True: [], False: []}
            for rep in range(reps + 1):
                for compiled in (True, False) if rep % 2 else (False, True):
                    start = time.perf_counter()
                    paged_attention(q, q, q, k_pool, v_pool, batch, block_size, window, scale, softcap,
                                    kernel if compiled else None)
                    if rep:   # the first of each is a warm-up
                        spent[compiled].append(time.perf_counter() - start)
            times[rows] = (statistics.median(spent[True]), statistics.median(spent[False]))
    finally:
        torch.set_num_threads(threads)
        kernel.min_rows = default
    kernel.min_rows = faster_from(times, default)
    return times
