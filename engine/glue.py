"""The operators between a layer's matmuls on the CPU, fused ahead of time by AOTInductor
(`CompiledGlue`): the rotary embedding of a pass's Q and K heads with the query's cast to the
attention dtype, the residual add with the RMSNorm after it, and the MLP's SiLU(gate) x up.
Eagerly each is two to eight small operators, each a dispatch, an allocation and a pass over
memory; fused, one generated loop. `engine.models.llama.LlamaModel` runs them on bfloat16
activations (native and bf16 weights) and on the float32 activations of native weights where the
CPU has no bfloat16 matmuls (AVX2); fp32 mode, the reference, keeps the eager operators.
Inductor computes a fused kernel in float32 and rounds to bfloat16 at its outputs only, where the
eager operators round after each operator, and sums the RMSNorm's squares in its own order:
bfloat16 outputs differ from the eager ones by at most one bfloat16 step, float32 ones by a few
float32 roundings (unit tests bound both), closer to float32 mode. Measured:
docs/PERFORMANCE.md, "The operators between the matmuls, fused" and "The fused operators on float32
activations and on one row".
"""

from __future__ import annotations

import torch

from engine.aot_kernel import AotPackage, package_for


class _RopeSplit(torch.nn.Module):
    """`engine.models.llama._rotate` of a pass's Q and K heads (the "rotate half" convention,
    ``x * cos + cat(x2, x1) * signed_sin``, the same products and sum in the same order as its
    ``roll``), split into Q cast to ``q_dtype``, K and V cast to ``kv_dtype``."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        t, d, half = qkv.shape[0], self.head_dim, self.head_dim // 2
        qk = qkv[:, :(self.heads + self.kv_heads) * d].view(t, self.heads + self.kv_heads, d)
        qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * signed_sin
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        v = qkv[:, (self.heads + self.kv_heads) * d:].view(t, self.kv_heads, d)
        return (q.to(self.q_dtype).contiguous(), k.to(self.kv_dtype).contiguous(),
                v.to(self.kv_dtype).contiguous())


class _AddNorm(torch.nn.Module):
    """``h + out`` and `engine.models.llama._rms_norm` of it (low-precision branch: normalized in
    float32, then scaled by a float32 weight and cast, or cast and scaled by a weight of the
    activations' dtype)."""

    def __init__(self, eps: float, weight_dtype: torch.dtype):
        super().__init__()
        self.eps, self.weight_dtype = eps, weight_dtype

    def forward(self, h: torch.Tensor, out: torch.Tensor, weight: torch.Tensor):
        h = h + out
        xf = h.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_dtype == torch.float32:
            return h, (xf * weight).to(h.dtype)
        return h, weight * xf.to(h.dtype)


class _SiluMul(torch.nn.Module):
    """The gated MLP's activation: ``silu(gate) * up`` of the fused gate/up projection's output."""

    def forward(self, gate_up: torch.Tensor):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class CompiledGlue:
    """The fused operators of a layer (module docstring), each one AOTInductor package for every
    pass (rows dynamic from one up), per torch thread count, dtypes, widths, head shape and
    epsilon, loaded from the disk cache or built at its first call (`warm_up` makes the calls at
    start-up; `engine.aot_kernel.package_for`); ``packages`` holds them, by key. Inputs are
    contiguous, as the model's pass makes them.

    Raises (from the call that builds a package): ``torch.export`` / inductor errors where
    inductor cannot build CPU code (no C++ compiler); `worker.kernels` turns them into a warning
    and leaves the eager operators in place.
    """

    min_rows = 1
    """Every pass goes through the packages (`worker.kernels` builds them for the thread counts
    of passes of this many tokens and more)."""

    def __init__(self) -> None:
        self.packages: dict[tuple, AotPackage] = {}

    def takes(self, rows: int) -> bool:
        """Whether a pass of ``rows`` tokens goes through the packages."""
        return rows >= self.min_rows

    def rope_split(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
                   kv_heads: int, head_dim: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` ``[T, (heads + 2 * kv_heads) * head_dim]`` (the fused projection's output,
        Q heads, K heads, V heads), rotary tables ``cos``, ``signed_sin`` ``[T, 1, head_dim]`` of
        ``qkv``'s dtype (`engine.models.rope.RotaryEmbedding.cos_sin`, whole-head rotation) -> rotated Q
        ``[T, heads, head_dim]`` in ``q_dtype``, rotated K and V ``[T, kv_heads, head_dim]`` in
        ``kv_dtype`` (the KV pool's), all three contiguous."""
        key = ("rope_split", qkv.dtype, qkv.shape[1], cos.dtype, heads, kv_heads, head_dim,
               q_dtype, kv_dtype)
        package = package_for(self.packages, "glue_rope", key, [__file__], lambda: _export(
            _RopeSplit(heads, kv_heads, head_dim, q_dtype, kv_dtype), (qkv, cos, signed_sin)))
        q, k, v = package(qkv, cos, signed_sin)
        return q, k, v

    def add_norm(self, h: torch.Tensor, out: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual ``h + out`` (both ``[T, hidden]``) and its RMSNorm with ``weight``
        ``[hidden]`` (float32 or ``h``'s dtype) and ``eps``: ``(h + out, norm)``, both in ``h``'s
        dtype."""
        key = ("add_norm", h.dtype, h.shape[1], weight.dtype, eps)
        package = package_for(self.packages, "glue_add_norm", key, [__file__],
                              lambda: _export(_AddNorm(eps, weight.dtype), (h, out, weight)))
        h, x = package(h, out, weight)
        return h, x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2 * intermediate]`` (gate columns, then up) -> ``silu(gate) * up``
        ``[T, intermediate]`` in ``gate_up``'s dtype."""
        key = ("silu_mul", gate_up.dtype, gate_up.shape[1])
        package = package_for(self.packages, "glue_silu_mul", key, [__file__],
                              lambda: _export(_SiluMul(), (gate_up,)))
        return package(gate_up)[0]

    def warm_up(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, q_dtype: torch.dtype, kv_dtype: torch.dtype, weight_dtype: torch.dtype,
                eps: float) -> None:
        """Load or build the three packages for these shapes on the current thread count before
        the first pass, and run each once on random rows under ``torch.inference_mode``."""
        with torch.inference_mode():
            t = 4
            self.rope_split(torch.randn(t, (heads + 2 * kv_heads) * head_dim).to(dtype),
                            *(torch.randn(t, 1, head_dim).to(dtype) for _ in range(2)), heads, kv_heads,
                            head_dim, q_dtype, kv_dtype)
            self.add_norm(torch.randn(t, hidden).to(dtype), torch.randn(t, hidden).to(dtype),
                          torch.ones(hidden, dtype=weight_dtype), eps)
            self.silu_mul(torch.randn(t, 2 * intermediate).to(dtype))


def _export(module: torch.nn.Module, example: tuple[torch.Tensor, ...]):
    """``module`` exported on fresh contiguous operands shaped as ``example`` with 5 rows, the
    rows of every operand that has them (all but a 1-D weight) dynamic from one up."""
    rows = torch.export.Dim("rows", min=1)
    args = tuple(torch.zeros(x.shape if x.dim() == 1 else (5, *x.shape[1:]), dtype=x.dtype) for x in example)
    dynamic = tuple(None if x.dim() == 1 else {0: rows} for x in args)
    return torch.export.export(module, args, dynamic_shapes=dynamic)
