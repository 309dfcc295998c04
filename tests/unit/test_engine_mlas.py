"""onnxruntime's MatMulNBits (engine/mlas.py): GGUF Q8_0 blocks map onto it exactly, and its
product with int8-rounded activations stays within a bound of the float product."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.mlas import NBitsMatMul, q8_codes, session_options

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def _q8_0(n=64, k=128, seed=0):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, T.Q8_0)


def test_q8_codes_give_back_the_files_codes_and_scales():
    data = _q8_0()
    w = torch.from_numpy(gguf.quants.dequantize(data, T.Q8_0))
    codes, scale = q8_codes(w)
    blocks = data.reshape(64, 4, 34)   # block_q8_0: float16 d, then 32 int8 codes
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].view(np.int8).reshape(64, 128)
    assert np.array_equal(scale, d)
    assert np.array_equal(codes.astype(np.int16) - 128, q)
    # and the zero block: scale 0, codes at the zero point
    codes, scale = q8_codes(torch.zeros(2, 32))
    assert not scale.any() and (codes == 128).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_codes(torch.zeros(2, 48))


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_q8_0_product_is_within_int8_activation_rounding(rows):
    data = _q8_0()
    w = torch.from_numpy(gguf.quants.dequantize(data, T.Q8_0))
    mm = NBitsMatMul(*q8_codes(w), bits=8)
    x = torch.randn(rows, 128)
    y = mm(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    ref = x.double() @ w.double().T
    # per 32-block int8 rounding of x: error per product <= |w| * step/2; about 0.5% in norm
    err = float((y.double() - ref).norm() / ref.norm())
    assert 0 < err < 1e-2
    # the float32/bfloat16 inputs give one answer (computed from float32)
    assert torch.equal(mm(x.double()), y)


def test_four_bit_codes_map_to_their_signed_values():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (48, 64)).astype(np.uint8)
    scale = (rng.random((48, 2)) * 0.1).astype(np.float32)
    w = torch.from_numpy((codes.astype(np.float32) - 8).reshape(48, 2, 32) * scale[..., None]).reshape(48, 64)
    x = torch.randn(2, 64)
    y = NBitsMatMul(codes, scale, bits=4)(x)
    ref = x @ w.T
    assert float((y - ref).norm() / ref.norm()) < 1e-2


def test_bad_shapes_are_refused():
    codes = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        NBitsMatMul(codes, np.ones((4, 2), np.float32), bits=3)
    with pytest.raises(ValueError, match="scale shape"):
        NBitsMatMul(codes, np.ones((4, 3), np.float32), bits=8)
    with pytest.raises(ValueError, match="exceed 4 bits"):
        NBitsMatMul(codes + 16, np.ones((4, 2), np.float32), bits=4)


def test_sessions_run_on_the_calling_thread_and_never_spin():
    import os

    so = session_options()
    assert so.intra_op_num_threads == 1 and so.inter_op_num_threads == 1
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    before = len(os.listdir("/proc/self/task"))
    mm = NBitsMatMul(np.full((64, 64), 128, np.uint8), np.ones((64, 2), np.float32), bits=8)
    # codes at the zero point: zero, up to the float rounding of the zero point's correction
    torch.testing.assert_close(mm(torch.randn(2, 64)), torch.zeros(2, 64), atol=1e-3, rtol=0)
    assert len(os.listdir("/proc/self/task")) == before   # no thread pool started


def test_row_int8_matmul_is_within_rounding_and_rows_do_not_share_a_scale():
    """`RowInt8MatMul` (W8A8, per-row activations, per-channel weights): within int8 rounding of
    the float product, and a row with a 1000x outlier beside it leaves a row's result as it was
    alone (a batch-wide activation scale would not)."""
    from engine.mlas import RowInt8MatMul

    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    mm = RowInt8MatMul(w)
    x = torch.randn(5, 64)
    y = mm(x)
    assert y.dtype == torch.float32 and y.shape == (5, 96)
    ref = x.double() @ w.double().T
    err = float((y.double() - ref).norm() / ref.norm())
    assert 0 < err < 2e-2
    loud = torch.cat([x[:1], 1000 * torch.randn(1, 64)])
    assert torch.equal(mm(loud)[0], mm(x[:1])[0])
    codes, s = mm.quantize(x)
    assert codes.dtype == np.uint8 and s.shape == (5, 1)
    assert torch.equal(torch.from_numpy(mm.gemm(codes)).float() * s * mm.col_scale, y)   # the two halves
