"""The model's layers as one ``torch.compile`` (inductor) graph per pass shape, with its matmuls
and its paged attention as opaque custom operators.

Inductor fuses what lies between the matmuls (norms, rotary, residual adds, the gated activation,
casts) into generated kernels and removes the per-operator Python dispatch of an eager pass. What
it must not trace stays eager behind two custom operators (``torch.library.custom_op``), as vLLM
splits its compiled graph at attention:

- ``pdserve::matmul(x, kernel)``: ``kernel`` indexes `KERNELS`, the model's projection objects
  (oneDNN-packed `engine.linear.Linear`, `engine.quant.Int4Linear`, the head, routed experts),
  whose weights live outside the graph and whose kernel choice depends on the row count;
- ``pdserve::attention(q, k, v, layer)``: writes the new tokens' K/V into the pool and attends
  through the block table (`engine.attention.paged_attention`), reading the pass's batch and pool
  from the `PassContext` the model's forward enters; the layer's ``on_layer_done`` hook runs there,
  once the layer's K/V are in the pool.

Off by default (``--enforce-eager``, vLLM's name, is the default): on the CPU these graphs are no
faster than the eager pass, and slower with dynamic shapes, while their build adds minutes to a
cold start (measured: docs/PERFORMANCE.md, "Compiled layers"). They are here for the devices
where a compiled step pays, and for measuring it (``python -m bench.threads --compiled``).

Shapes are dynamic in the token count (one graph for every pass of two tokens or more; torch
specializes a one-token pass into a graph of its own). Inductor's caches are on disk (torch's
default, ``/tmp/torchinductor_<user>``; ``TORCHINDUCTOR_CACHE_DIR`` moves them), so a restarted
worker reuses the generated code instead of compiling it again.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

KERNELS: list[Callable[[torch.Tensor], torch.Tensor]] = []
_OUT_FEATURES: list[int] = []
_LOCK = threading.Lock()
_CONTEXT = threading.local()


def register_kernel(fn: Callable[[torch.Tensor], torch.Tensor], out_features: int) -> int:
    """Make ``fn`` (``[tokens, in]`` -> ``[tokens, out_features]`` in the input's dtype) callable
    from a compiled graph; returns its index for ``pdserve::matmul``."""
    with _LOCK:
        KERNELS.append(fn)
        _OUT_FEATURES.append(out_features)
        return len(KERNELS) - 1


@torch.library.custom_op("pdserve::matmul", mutates_args=())
def matmul(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """``KERNELS[kernel](x)``: ``[tokens, in]`` -> ``[tokens, out]``, ``x``'s dtype."""
    return KERNELS[kernel](x)


@matmul.register_fake
def _(x: torch.Tensor, kernel: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _OUT_FEATURES[kernel]))


class PassContext:
    """The pass the attention operator serves: ``with PassContext(attend):`` around a compiled
    call, ``attend(q, k, v, layer) -> [tokens, heads * head_dim]`` doing the layer's K/V writes and
    attention (and its hook). Thread-local: each thread runs its own passes."""

    def __init__(self, attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]):
        self.attend = attend

    def __enter__(self) -> "PassContext":
        self._outer = getattr(_CONTEXT, "current", None)
        _CONTEXT.current = self
        return self

    def __exit__(self, *exc) -> None:
        _CONTEXT.current = self._outer


@torch.library.custom_op("pdserve::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The current `PassContext`'s ``attend``: ``q`` ``[tokens, heads, head_dim]``, ``k``, ``v``
    ``[tokens, kv_heads, head_dim]`` -> ``[tokens, heads * head_dim]`` in ``q``'s dtype.
    Raises RuntimeError outside a `PassContext`."""
    ctx = getattr(_CONTEXT, "current", None)
    if ctx is None:
        raise RuntimeError("pdserve::attention called outside a PassContext")
    return ctx.attend(q, k, v, layer)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def compile_fn(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile`` (inductor, dynamic shapes, no whole-graph requirement)."""
    return torch.compile(fn, dynamic=True)
