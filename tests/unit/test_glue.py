"""`engine.glue.CompiledGlue`: the fused operators between a layer's matmuls against the eager
operators they replace (`engine.models.llama`), on SmolLM2-135M's shapes (the packages a CPU
worker of the default model loads, built once per machine): bfloat16 activations, and the float32
ones of native weights on a CPU without bfloat16 matmuls, one row and many through one package."""

from collections import Counter

import pytest
import torch

from engine.glue import CompiledGlue
from engine.models.llama import _rms_norm, _rotate

pytestmark = pytest.mark.unit

HIDDEN, INTER, HEADS, KV_HEADS, DIM, EPS = 576, 1536, 9, 3, 64, 1e-5


def _bf16_steps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between ``got`` and ``want`` (bfloat16) in bfloat16 steps."""
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    same_sign = (a >= 0) == (b >= 0)
    return int(torch.where(same_sign, (a - b).abs(), torch.full_like(a, 1 << 16)).max())


@pytest.fixture(scope="module")
def glue():
    return CompiledGlue()


@pytest.mark.parametrize("rows", [2, 37, 300])
def test_rope_split_is_the_float32_rotation_rounded_once(glue, rows):
    """Q and K rotated ("rotate half") from the fused QKV output: the float32 products and sum
    rounded once to bfloat16 for K (Q kept in float32: that sum); the eager operators, which round
    after each product and the sum, within a bfloat16 step of the terms."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=g).bfloat16()
    cos, sin = (torch.randn(rows, 1, DIM, generator=g).bfloat16() for _ in range(2))
    with torch.inference_mode():
        q, k, v = glue.rope_split(qkv, cos, sin, HEADS, KV_HEADS, DIM, torch.float32, torch.bfloat16)
        x = qkv[:, :(HEADS + KV_HEADS) * DIM].view(rows, HEADS + KV_HEADS, DIM).float()
        want = x * cos.float() + torch.cat([x[..., DIM // 2:], x[..., :DIM // 2]], -1) * sin.float()
        eager = _rotate(qkv[:, :(HEADS + KV_HEADS) * DIM].view(rows, HEADS + KV_HEADS, DIM), cos, sin)
    assert q.dtype == torch.float32 and q.shape == (rows, HEADS, DIM) and q.is_contiguous()
    assert k.dtype == torch.bfloat16 and k.shape == (rows, KV_HEADS, DIM) and k.is_contiguous()
    assert torch.equal(v, qkv[:, (HEADS + KV_HEADS) * DIM:].view(rows, KV_HEADS, DIM)) and v.is_contiguous()
    assert torch.equal(k, want[:, HEADS:].bfloat16())
    assert torch.equal(q.bfloat16(), want[:, :HEADS].bfloat16())
    assert torch.allclose(q, want[:, :HEADS], rtol=2e-7, atol=1e-6)
    # eager rounds both products and the sum: within a bfloat16 step of the terms' magnitude
    terms = (x * cos.float()).abs() + (torch.cat([x[..., DIM // 2:], x[..., :DIM // 2]], -1) * sin.float()).abs()
    assert ((torch.cat([q, k.float()], 1) - eager.float()).abs() <= 2 ** -7 * terms).all()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 300])
def test_add_norm_is_the_residual_add_and_rms_norm(glue, rows, weight_dtype):
    """The residual sum exactly as eager's bfloat16 add, and its RMSNorm within one bfloat16 step
    of `_rms_norm` (inductor sums the squares in its own order and does not round between the
    norm and the weight's product), with outlier channels as SmolLM2's residual stream has."""
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, HIDDEN, generator=g) * 2).bfloat16()
    h[:, 7] *= 40   # an outlier channel
    out = torch.randn(rows, HIDDEN, generator=g).bfloat16()
    h[0], out[0] = h[0] * 1e-3, out[0] * 1e-3   # a row whose mean square is near eps: eps counts
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(weight_dtype)
    with torch.inference_mode():
        h2, x = glue.add_norm(h, out, weight, EPS)
        want = _rms_norm(h + out, (HIDDEN,), weight, EPS)
    assert torch.equal(h2, h + out)
    assert x.dtype == torch.bfloat16 and _bf16_steps(x, want) <= 1


@pytest.mark.parametrize("rows", [2, 300])
def test_silu_mul_is_the_gated_activation(glue, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * INTER, generator=g) * 3).bfloat16()
    with torch.inference_mode():
        got = glue.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        want = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
    assert got.shape == (rows, INTER) and got.dtype == torch.bfloat16
    assert _bf16_steps(got, want) <= 1
    assert _bf16_steps(got, torch.nn.functional.silu(gate) * up) <= 1


@pytest.mark.parametrize("rows", [1, 2, 300])
def test_float32_operators_are_the_eager_ones_to_a_few_roundings(glue, rows):
    """Native weights' float32 activations (a CPU without bfloat16 matmuls; its KV pool in
    bfloat16), one row and many: Q's rotation and the gated activation equal eager's to float32
    rounding, K and V as eager casts them for the pool, the residual add exactly, its RMSNorm
    (``F.rms_norm`` eagerly) to a few roundings of its sum of squares."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=g)
    cos, sin = torch.randn(rows, 1, DIM, generator=g), torch.randn(rows, 1, DIM, generator=g)
    h, out = torch.randn(rows, HIDDEN, generator=g) * 2, torch.randn(rows, HIDDEN, generator=g)
    h[:, 7] *= 40
    h[0], out[0] = h[0] * 1e-3, out[0] * 1e-3   # a row whose mean square is near eps: eps counts
    weight = torch.rand(HIDDEN, generator=g) + 0.5
    gate_up = torch.randn(rows, 2 * INTER, generator=g) * 3
    with torch.inference_mode():
        q, k, v = glue.rope_split(qkv, cos, sin, HEADS, KV_HEADS, DIM, torch.float32, torch.bfloat16)
        h2, x = glue.add_norm(h, out, weight, EPS)
        act = glue.silu_mul(gate_up)
        rotated = _rotate(qkv[:, :(HEADS + KV_HEADS) * DIM].view(rows, HEADS + KV_HEADS, DIM), cos, sin)
        gate, up = gate_up.chunk(2, dim=-1)
        want_act = torch.nn.functional.silu(gate) * up
        want_x = _rms_norm(h + out, (HIDDEN,), weight, EPS)
    assert q.shape == (rows, HEADS, DIM) and k.shape == v.shape == (rows, KV_HEADS, DIM)
    assert q.dtype == x.dtype == act.dtype == torch.float32 and k.dtype == v.dtype == torch.bfloat16
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    torch.testing.assert_close(q, rotated[:, :HEADS], rtol=1e-6, atol=1e-6)
    # K and V as the eager pass stores them in the bfloat16 pool: rounded once from float32
    assert _bf16_steps(k, rotated[:, HEADS:].bfloat16()) <= 1
    assert torch.equal(v, qkv[:, (HEADS + KV_HEADS) * DIM:].view(rows, KV_HEADS, DIM).bfloat16())
    assert torch.equal(h2, h + out)
    torch.testing.assert_close(x, want_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(act, want_act, rtol=1e-6, atol=1e-6)


def test_one_package_per_operator_serves_every_row_count(glue):
    """Rows are dynamic from one up (a decode step of one sequence included): after the calls
    above (1 to 300 rows; bfloat16 with two weight dtypes, float32), one package per operator and
    dtypes, and warming up for float32 activations finds them all."""
    before = set(glue.packages)
    with torch.inference_mode():
        glue.warm_up(HIDDEN, INTER, HEADS, KV_HEADS, DIM, torch.float32, torch.float32, torch.bfloat16,
                     torch.float32, EPS)
    assert set(glue.packages) == before
    bf16, fp32 = torch.bfloat16, torch.float32   # keys: (threads, operator, dtype, ...)
    assert Counter((op, dtype) for _, op, dtype, *_ in glue.packages) == Counter(
        [("add_norm", bf16)] * 2 + [("rope_split", bf16), ("silu_mul", bf16)]
        + [("add_norm", fp32), ("rope_split", fp32), ("silu_mul", fp32)])
    assert glue.takes(1)
