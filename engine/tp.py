"""Tensor parallelism: a decoder's weights sharded over N ranks, and the collectives its pass calls.

Megatron-style (Shoeybi et al., "Megatron-LM", 2019, section 3; vLLM's ``QKVParallelLinear``,
``RowParallelLinear`` and ``VocabParallelEmbedding`` split the same way):

- **Q/K/V and gate/up, column-parallel**: rank r computes query heads ``[r H/N, (r+1) H/N)``, their
  K/V heads, and rows ``[r I/N, (r+1) I/N)`` of the gated MLP's inner width; no communication.
- **O and down, row-parallel**: rank r multiplies its slice of their input features; the partial
  sums are all-reduced (O's bias, when there is one, added once after the sum).
- **KV heads**: when N divides the KV heads, rank r holds heads ``[r KV/N, (r+1) KV/N)``; when the
  KV heads divide N (N > KV), rank r holds the one head its query heads read, ``r // (N / KV)``,
  replicated on N / KV ranks (as vLLM does). Each rank's KV pool holds its heads only.
- **Embedding and LM head, vocabulary-parallel**: rank r holds rows ``[r Vp, min((r+1) Vp, V))``,
  ``Vp = ceil(V / N)``; a token outside a rank's rows embeds to zeros there and the all-reduce
  adds the one rank's row (exact: the other terms are 0); each rank's logits columns are gathered
  on rank 0.
- **Routed experts, expert-parallel**: rank r runs the experts ``e`` with ``e % N == r`` on the
  tokens routed to them (the router is replicated, so every rank routes alike); the block's
  output is all-reduced with the other row-parallel sums.

Norms, rotary tables and the Q/K norm weights are replicated. The ranks of one group run in
processes of their own (`engine.tp_ranks`) under ``torch.distributed`` (gloo on the CPU; NCCL on
CUDA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.quant import GROUP_SIZE, Int4Weight
from engine.weights import LlamaWeights


@dataclass
class TPGroup:
    """One rank's place in a tensor-parallel group and the collectives it calls.

    Attributes:
        rank: this process's TP rank, 0 .. size - 1 (rank 0 drives the others).
        size: the TP size N.
        group: the ``torch.distributed`` process group backend of the model's collectives (made
            by `engine.tp_ranks.make_group`: gloo on the CPU, NCCL on CUDA; called through its own
            methods: it is no registered ``torch.distributed`` group, so one process may hold
            several); None when ``size`` is 1.
        commands: the gloo group rank 0's commands are broadcast over (host tensors), the same
            as ``group`` on the CPU.
    """

    rank: int
    size: int
    group: object = None
    commands: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (returned). Raises RuntimeError (torch.distributed)
        when a rank is gone."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor, width: int, total: int) -> torch.Tensor:
        """Rank 0: the ranks' column blocks ``x`` ``[rows, <= width]`` side by side, ``[rows,
        total]``; each is padded to ``width`` to be gathered, the padding cut. Other ranks get
        ``x`` back (their result is not used)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        if x.shape[1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        x = x.contiguous()
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.group.gather(parts, [x], opts).wait()
        return torch.cat(parts[0], dim=1)[:, :total] if self.rank == 0 else x


def vocab_rows(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """``(first, count)``: the embedding / LM head rows rank ``rank`` of ``size`` holds (module
    doc); ``count`` may be 0 for the last ranks of a tiny vocabulary."""
    per = -(-vocab // size)
    first = min(rank * per, vocab)
    return first, min(per, vocab - first)


def kv_heads_of(config: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """``(first, count)``: the KV heads rank ``rank`` of ``size`` holds (module doc)."""
    kv = config.num_kv_heads
    if kv % size == 0:
        return rank * (kv // size), kv // size
    return rank // (size // kv), 1


def check_shardable(config: ModelConfig, size: int) -> None:
    """Refuse a TP size the model cannot be split into.

    Raises:
        ModelLoadError: ``size`` < 1; ``num_heads``, ``intermediate_size`` (a model with a dense
            MLP layer) not divisible by ``size``; ``num_kv_heads`` neither a multiple nor a divisor
            of ``size``. The message names the field and both numbers.
    """
    if size < 1:
        raise ModelLoadError(f"tensor parallel size must be >= 1, got {size}")
    if config.num_heads % size:
        raise ModelLoadError(f"model config: num_heads={config.num_heads} is not divisible by tensor parallel "
                             f"size {size}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ModelLoadError(f"model config: num_kv_heads={kv} is neither a multiple nor a divisor of tensor "
                             f"parallel size {size}")
    dense = len(config.moe_layers) < config.num_layers
    if dense and config.intermediate_size % size:
        raise ModelLoadError(f"model config: intermediate_size={config.intermediate_size} is not divisible by "
                             f"tensor parallel size {size}")


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank computes with: ``num_heads / size`` query heads, its KV heads
    (`kv_heads_of`), ``intermediate_size / size``; every other field (vocabulary, hidden size,
    rope, windows) as the model's. Its ``num_kv_heads`` is what the rank's KV pool holds."""
    if size == 1:
        return config
    check_shardable(config, size)
    dense = len(config.moe_layers) < config.num_layers
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=kv_heads_of(config, 0, size)[1],
                               intermediate_size=config.intermediate_size // size if dense else config.intermediate_size)


def shard_weights(config: ModelConfig, weights: LlamaWeights, rank: int, size: int) -> LlamaWeights:
    """Keep rank ``rank``'s shard of ``weights`` (module doc), replacing each sharded tensor by a
    contiguous copy of its slice, so the full tensor is freed once nothing else holds it.

    Args:
        weights: a whole model's weights as the loaders return them (fused ``wqkv`` rows Q then K
            then V, ``w_gate_up`` rows gate then up); changed in place and returned.
    Raises:
        ModelLoadError: `check_shardable`; a 4-bit projection whose input slice does not fall on
            its 32-weight groups (``num_heads / size * head_dim`` or ``intermediate_size / size``
            not a multiple of 32).
    """
    if size == 1:
        return weights
    check_shardable(config, size)
    d, heads = config.head_dim, config.num_heads // size
    kv_first, kv_count = kv_heads_of(config, rank, size)
    q_rows = (rank * heads * d, (rank + 1) * heads * d)
    k0 = config.num_heads * d + kv_first * d
    v0 = (config.num_heads + config.num_kv_heads) * d + kv_first * d
    qkv = [q_rows, (k0, k0 + kv_count * d), (v0, v0 + kv_count * d)]
    inter = config.intermediate_size // size
    gate_up = [(rank * inter, (rank + 1) * inter),
               (config.intermediate_size + rank * inter, config.intermediate_size + (rank + 1) * inter)]
    for i, layer in enumerate(weights.layers):
        layer.wqkv = _rows(layer.wqkv, qkv)
        if layer.bqkv is not None:
            layer.bqkv = _rows(layer.bqkv, qkv)
        layer.wo = _columns(layer.wo, q_rows, f"layer {i} attention output")
        if layer.w_gate_up is not None:
            layer.w_gate_up = _rows(layer.w_gate_up, gate_up)
            layer.w_down = _columns(layer.w_down, gate_up[0], f"layer {i} MLP down")
        if layer.experts is not None:
            for e in range(len(layer.experts.gate_up)):
                if e % size != rank:
                    layer.experts.gate_up[e] = layer.experts.down[e] = None
    first, count = vocab_rows(config.vocab_size, rank, size)
    tied = weights.lm_head is weights.embed
    weights.embed = weights.embed[first:first + count].clone()
    weights.lm_head = weights.embed if tied else weights.lm_head[first:first + count].clone()
    return weights


def _rows(w, ranges: list[tuple[int, int]]):
    """The rows of ``ranges`` of a dense tensor (1-D bias or 2-D weight) or an `Int4Weight`,
    stacked into a new one."""
    if isinstance(w, Int4Weight):
        return Int4Weight.cat([Int4Weight(w.codes[a:b], w.scale[a:b], w.minimum[a:b]) for a, b in ranges])
    return torch.cat([w[a:b] for a, b in ranges]).contiguous()


def _columns(w, cols: tuple[int, int], what: str):
    """Input features ``cols`` of a weight ``[out, in]`` (dense or `Int4Weight`, whose group
    boundaries the slice must keep)."""
    a, b = cols
    if isinstance(w, Int4Weight):
        if a % GROUP_SIZE or b % GROUP_SIZE:
            raise ModelLoadError(f"{what}: 4-bit weights are grouped by {GROUP_SIZE} input features and this "
                                 f"rank's slice [{a}, {b}) splits a group; use --weights fp32 or bf16 at this "
                                 "tensor parallel size")
        g0, g1 = a // GROUP_SIZE, b // GROUP_SIZE
        return Int4Weight(w.codes[:, a:b].contiguous(), w.scale[:, g0:g1].contiguous(),
                          w.minimum[:, g0:g1].contiguous())
    return w[:, a:b].contiguous()
