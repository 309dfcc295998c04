"""The decode step replayed from CUDA graphs, one per batch-size bucket (vLLM's and SGLang's
"cuda graph" decode; PyTorch's ``torch.cuda.CUDAGraph``).

A decode step launches every kernel of every layer from Python; on a GPU that launch time, not
the arithmetic, sets the step time of a small model. `DecodeGraphs` records the model's forward
once per bucket ``B`` (1, 2, 4, 8, then multiples of 8, up to ``max_batch``) over static device
buffers, and a step of ``n <= max_batch`` sequences copies its inputs into those buffers and
replays the graph of the smallest bucket ``>= n``:

- static inputs: token ids, positions, slots ``[B]`` int64; block tables ``[B, max_blocks]``
  int64 and context lengths ``[B]`` int32 (what the Triton decode kernel reads,
  `engine.triton_attention`); the logits rows are ``0 .. B-1``.
- padding rows (``n .. B-1``) write their K/V into one block the graphs hold for themselves
  (allocated from the pool at construction and never freed: SGLang reserves a padding slot the
  same way; vLLM skips slot -1 in its cache kernel), attend over that block alone (length 1), and
  their logits are dropped. Rows never mix in a decode step, so padding cannot change a real
  row's result.

Supported where the forward reads nothing but those tensors: the Triton decode path (a CUDA
device, or the CPU under ``TRITON_INTERPRET=1`` for the tests, with ``capture=False``), rotary
tables indexed by position only (no length-dependent rope), and no routed experts (their
dispatch reads counts back on the host). `unsupported` says why not.
"""

from __future__ import annotations

import torch

from engine.attention import ForwardBatch
from engine.kv_cache import KVPool


def buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 24, ... up to ``max_batch`` (included)."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))


def unsupported(model) -> str | None:
    """Why `DecodeGraphs` cannot record ``model``'s decode step, or None when it can."""
    from engine import triton_attention

    if not triton_attention.available(model.device):
        return f"the Triton decode kernel cannot run on {model.device}"
    if getattr(model.config, "num_experts", 0):
        return "routed experts read their token counts back on the host"
    if any(rope.kind is not None for rope in getattr(model, "_ropes", ())):
        return "a length-dependent rope reads each sequence's length on the host"
    if getattr(model, "tp_size", 1) > 1:
        return "tensor-parallel passes go through the ranks' command pipes"
    return None


class DecodeGraphs:
    """CUDA graphs of ``model``'s decode step over ``pool`` (module doc).

    Args:
        model: the `CausalLM` (on a CUDA device to capture).
        pool: its `KVPool`; one block is taken from its allocator for the padding rows.
        max_batch: the largest step replayed (sequences); larger steps run eagerly.
        max_context: the longest context (tokens) a replayed sequence may have; longer ones run
            eagerly. Sets the block tables' width.
        capture: record graphs (CUDA); False replays by calling the forward over the same static
            buffers, which is how the CPU tests check the buffers and the padding.
    Raises:
        ValueError: the model is `unsupported`, or ``max_batch`` < 1.
        CapacityError: the pool has no free block for the padding rows.
    """

    def __init__(self, model, pool: KVPool, max_batch: int, max_context: int, capture: bool = True):
        reason = unsupported(model)
        if reason:
            raise ValueError(f"CUDA graphs cannot record this model's decode step: {reason}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.pool, self.capture = model, pool, capture
        self.max_batch, self.block_size = max_batch, pool.block_size
        self.max_blocks = -(-max_context // pool.block_size)
        (self.pad_block,) = pool.allocator.allocate(1)
        dev = model.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), self.pad_block * self.block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((max_batch, self.max_blocks), self.pad_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.rows = torch.arange(max_batch, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0   # steps run from the graphs (`run`)
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        for b in sorted(buckets(max_batch), reverse=True):   # largest first: the others reuse its memory
            self.graphs[b] = self._record(b) if capture else (None, None)

    def _batch(self, b: int) -> ForwardBatch:
        """The static buffers' first ``b`` rows as a decode `ForwardBatch` (on the device)."""
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            slot_mapping=self.slots[:b], logits_indices=self.rows[:b], is_decode=True,
                            seq_ranges=[], block_tables=self.tables[:b], decode_lens=None,
                            decode_lens_t=self.lens[:b])

    def _record(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._batch(b)
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):   # Triton's JIT, cuBLAS workspaces, compiled graphs: before capture
                self.model.forward(batch, self.pool)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool), torch.inference_mode():
            out = self.model.forward(batch, self.pool)
        return graph, out

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket ``batch`` replays in, or None when it runs eagerly (not a decode step of
        ``<= max_batch`` sequences within ``max_context``)."""
        if not batch.is_decode or batch.block_tables is None:
            return None
        n = len(batch.seq_ranges)
        if n > self.max_batch or batch.block_tables.shape[1] > self.max_blocks:
            return None
        return min(b for b in self.graphs if b >= n)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The ``[n, vocab]`` float32 logits of the decode step ``batch`` (built on the host,
        `ForwardBatch.build`), its K/V written into the pool; None when it runs eagerly instead
        (`bucket`)."""
        b = self.bucket(batch)
        if b is None:
            return None
        n, width = len(batch.seq_ranges), batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slots[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        self.lens[:n].copy_(torch.tensor(batch.decode_lens, dtype=torch.int32), non_blocking=True)
        self.input_ids[n:b] = 0
        self.positions[n:b] = 0
        self.slots[n:b] = self.pad_block * self.block_size
        self.tables[n:b] = self.pad_block
        self.lens[n:b] = 1
        graph, out = self.graphs[b]
        self.replays += 1
        if graph is None:
            out = self.model.forward(self._batch(b), self.pool)
        else:
            graph.replay()
        return out[:n].clone()
