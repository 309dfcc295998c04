"""The interface between the model runner and a model family.

A model family (`engine.models.llama`, ...) is a class that computes a forward pass over a
`ForwardBatch`, reading and writing K/V through a paged `KVPool`, and says what K/V each layer
stores so the pool (and the transfer plan built on the pool's layout) can be checked against it.
The runner (`engine.runner.ModelRunner`) and the workers talk to a model through `CausalLM`
only; `engine.models.registry` maps a checkpoint's architecture to its class, so a new family
touches no runner, worker or transfer code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from engine.attention import ForwardBatch
from engine.config import ModelConfig
from engine.kv_cache import KVPool

LayerCallback = Callable[[int], None]
"""Called with a layer's index once that layer's K/V are in the pool."""


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer stores per token in the KV pool: ``num_kv_heads`` K and V heads
    of ``head_dim`` elements each."""

    num_kv_heads: int
    head_dim: int


class CausalLM(Protocol):
    """A decoder-only model over a paged KV pool.

    Attributes:
        config: the hyper-parameters the checkpoint gave (`ModelConfig`).
        device: where the weights and the pool live.
        kv_dtype: the dtype the pool must have.
    """

    config: ModelConfig
    device: torch.device
    kv_dtype: torch.dtype

    def kv_layers(self) -> list[LayerKV]:
        """One `LayerKV` per decoder layer, in order."""
        ...

    def forward(self, batch: ForwardBatch, pool: KVPool,
                on_layer_done: LayerCallback | None = None) -> torch.Tensor:
        """Write the new tokens' K/V into ``pool`` and return the ``[len(batch.logits_indices),
        vocab_size]`` float32 logits; ``on_layer_done(i)`` runs once layer ``i``'s K/V are in
        the pool. Raises ValueError when the pool does not fit the model (`check_pool`)."""
        ...

    def warm_up(self, pool: KVPool) -> float:
        """Build whatever a model builds at its first passes (compiled graphs) now, with passes
        over blocks of ``pool`` taken and given back; returns the seconds it took (0.0: nothing
        to build)."""
        ...


def check_pool(model: CausalLM, pool: KVPool) -> None:
    """Raise ValueError, naming both sides, unless ``pool`` stores what ``model`` writes: one K and
    one V plane per layer of its `LayerKV` heads and width, in its ``kv_dtype``."""
    layers = model.kv_layers()
    _, two, heads, _, _, dim = pool.kv.shape
    got = [LayerKV(heads, dim)] * pool.kv.shape[0]
    if two != 2 or got != layers:
        raise ValueError(f"KV pool of {pool.kv.shape[0]} layers x {heads} heads x {dim} does not fit the "
                         f"model's {len(layers)} layers ({layers[0] if layers else None} each)")
    if pool.kv.dtype != model.kv_dtype:
        raise ValueError(f"KV pool dtype {pool.kv.dtype} differs from the model's {model.kv_dtype}")
