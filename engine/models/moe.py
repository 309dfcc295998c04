"""A routed-experts MLP block (Mixtral, Qwen3-MoE): each token goes through its top-k experts.

Routing (Hugging Face ``modeling_mixtral.py`` / ``modeling_qwen3_moe.py``, ``*TopKRouter``): router
logits ``x @ router.T``, softmax over all experts in float32, the ``top_k`` largest kept, divided
by their sum when ``norm_topk_prob`` (always for Mixtral), then cast to the activations' dtype.
Each expert is a SwiGLU MLP; a token's output is the routing-weighted sum of its experts'
outputs. Experts run one at a time over the rows routed to them (no padding, no capacity limit:
no token is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.linear import Linear


@dataclass
class ExpertWeights:
    """One layer's experts.

    Attributes:
        router: ``[num_experts, hidden]``.
        gate_up: per expert ``[2 * moe_intermediate, hidden]`` (gate rows, then up rows).
        down: per expert ``[hidden, moe_intermediate]``.
    """

    router: torch.Tensor
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]


class RoutedExperts:
    """``y = sum_k weight_k * expert_k(x)`` over each token's top-k experts.

    Args:
        weights: the layer's `ExpertWeights`.
        top_k: experts per token (``num_experts_per_tok``).
        norm_topk_prob: renormalize the kept probabilities to sum to 1.
        backend: `engine.linear` backend for the experts' projections. Each expert's weight is
            set to None in ``weights`` once its `Linear` is built (the model owns the weights:
            `engine.models.llama.LlamaModel`). An expert whose weights are None is another
            tensor-parallel rank's (`engine.tp`, expert-parallel): its tokens get nothing here
            and the all-reduce after the block adds that rank's part.
    Call with ``x``: ``[tokens, hidden]``; returns ``[tokens, hidden]`` in ``x``'s dtype.
    """

    def __init__(self, weights: ExpertWeights, top_k: int, norm_topk_prob: bool, backend: str):
        self.router = weights.router
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate_up = _take_linears(weights.gate_up, backend)
        self.down = _take_linears(weights.down, backend)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, top_k]``: routing weights in ``x``'s dtype and
        expert indices (int64)."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        order = torch.argsort(experts.flatten(), stable=True)
        counts = torch.bincount(experts.flatten(), minlength=len(self.gate_up)).tolist()
        rows = order // self.top_k   # token of each (token, k) pair, grouped by expert
        scales = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or self.gate_up[e] is None:
                start += n
                continue
            tokens = rows[start:start + n]
            gate, up = self.gate_up[e](x.index_select(0, tokens)).chunk(2, dim=-1)
            y = self.down[e](F.silu(gate) * up) * scales[start:start + n, None]
            out.index_add_(0, tokens, y)
            start += n
        return out


def _take_linears(weights: list[torch.Tensor], backend: str) -> list[Linear]:
    """A `Linear` per weight (None for None: another rank's expert), each weight set to None in
    ``weights`` once built (so that no more than one expert's original outlives its packed form)."""
    out = []
    for i, w in enumerate(weights):
        weights[i] = None
        out.append(None if w is None else Linear(w, backend))
    return out
