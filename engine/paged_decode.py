"""Decode attention that reads the KV pool through the block table on the CPU: `paged_decode_indexed`
(torch indexing over the pool) and `CompiledDecode` (it through ``torch.compile``), the kernel of
``--attention-backend compiled|auto``; `engine.attention._decode_attention` dispatches to it.
Measured against the grouped path: docs/PERFORMANCE.md, "Decode attention through the block table"."""

from __future__ import annotations

import torch

from engine.attention import ForwardBatch


def paged_decode_indexed(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor, window: int | None = None,
                         scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Decode attention written as torch indexing of the pool through the block table: no
    gathered copy of any sequence's K/V is built when inductor compiles it (``torch.compile``
    fuses the indexing into the score and output reductions); eagerly it is a slow reference.
    Whole blocks are indexed (``pool[block_tables]``), so the generated loops read one table entry
    per block and the block's positions contiguously, and the softmax is normalised after the
    value reduction (the same sum, divided once per output).
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
    qg = q.view(d, 1, kv_heads, groups, 1, dim) * (dim ** -0.5 if scale is None else scale)
    # whole blocks through the table: one index per block, the positions inside it contiguous
    k = k_pool[block_tables]                                          # [D, W, kv_heads, block, dim]
    s = (qg * k[:, :, :, None].to(q.dtype)).sum(-1)                   # [D, W, kv_heads, G, block]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = (torch.arange(width, device=q.device)[:, None] * block_size
           + torch.arange(block_size, device=q.device)[None, :])      # [W, block]
    hidden = pos[None] >= lens[:, None, None]                         # [D, W, block]
    if window is not None:
        hidden = hidden | (pos[None] < (lens - window)[:, None, None])
    s = s.masked_fill(hidden[:, :, None, None, :], float("-inf"))
    e = torch.exp(s - s.amax(dim=(1, 4), keepdim=True))             # softmax over (W, block), normalised last
    v = v_pool[block_tables]                                          # [D, W, kv_heads, block, dim]
    out = (e[..., None] * v[:, :, :, None].to(q.dtype)).sum(dim=(1, 4))   # [D, kv_heads, G, dim]
    out = out / e.sum(dim=(1, 4)).view(d, kv_heads, groups, 1)
    return out.reshape(d, heads * dim)


def configure_inductor() -> None:
    """Inductor as the worker's compiled kernels use it (`CompiledDecode`,
    `engine.flex_prefill.CompiledPrefill`): it compiles in the calling process
    (``compile_threads = 1``: no pool of compile workers left running), and takes the CPU's vector
    instructions from torch's own detection (``cpp.vec_isa_ok``) unless
    ``TORCHINDUCTOR_VEC_ISA_OK`` set it: no probe libraries built and loaded in child processes
    at every start."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    if inductor_config.cpp.vec_isa_ok is None:
        inductor_config.cpp.vec_isa_ok = True


class CompiledDecode:
    """`paged_decode_indexed` through ``torch.compile`` (inductor): the CPU decode-attention
    kernel of a worker started with ``--attention-backend compiled`` (or ``auto``); K/V are read from the pool
    through the block table, never gathered into a copy (measured against the grouped path:
    docs/PERFORMANCE.md, "Decode attention through the block table").

    One graph serves every decode batch of one pool: the batch size and the block table's width
    are marked dynamic, and a batch of one row or a table of one column is padded to two (torch
    specializes sizes 0 and 1, which would build three more graphs). The graph is built for a
    thread count and torch guards on it: the kernel runs on the calling pass's threads, one graph
    per count (a worker builds one for each count its passes may take before the first request,
    `worker.runtime`; measured: docs/PERFORMANCE.md, "Decode attention on the pass's threads,
    and where a served core goes"). A new pool (its shape), dtype, window, scale or
    soft-cap builds another graph. A model's ``warm_up`` builds it for the current count.
    Inductor compiles in the calling process (``compile_threads = 1``: no compile workers), and
    takes the CPU's vector instructions from torch's own detection (``cpp.vec_isa_ok``, unless
    ``TORCHINDUCTOR_VEC_ISA_OK`` says otherwise) instead of compiling and loading probe libraries
    in child processes at every start: a compiler that cannot build for them fails the first call,
    as below.

    Raises (from the first call): ``torch._inductor`` / ``torch._dynamo`` errors when inductor
    cannot build CPU code (no C++ compiler); `worker.runtime` turns that into a refusal to start.
    """

    min_rows = 4
    """Default of ``min_rows`` (`__init__`)."""

    def __init__(self, min_rows: int = min_rows):
        """``min_rows``: decode batches of fewer one-token sequences keep the grouped path, where
        this kernel's fixed cost per call (guards, padding) outweighs its gain (measured:
        docs/PERFORMANCE.md, "Decode attention through the block table")."""
        self.min_rows = min_rows
        configure_inductor()
        self._fn = torch.compile(paged_decode_indexed, dynamic=False)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
                 window: int | None, scale: float | None, softcap: float | None) -> torch.Tensor:
        """``q`` ``[D, heads, head_dim]`` (the batch's one-token sequences, in `ForwardBatch`
        order) over one layer's pool -> ``[D, heads * head_dim]`` in ``q``'s dtype."""
        tables, lens = batch.indexed_decode_inputs()
        rows = q.shape[0]
        if rows == 1:
            q = q.expand(2, -1, -1)
        q = q.contiguous()
        for t, dims in ((q, (0,)), (tables, (0, 1)), (lens, (0,))):
            for dim in dims:
                torch._dynamo.mark_dynamic(t, dim)
        return self._fn(q, k_pool, v_pool, tables, lens, window, scale, softcap)[:rows]
