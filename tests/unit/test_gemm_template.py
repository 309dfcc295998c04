"""`engine.gemm_template`: inductor's GEMM template built once per weight shape and loaded with each
projection's own weight, packed in the template's layout, multiplies as ``F.linear`` does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.gemm_template import LAYOUT_CANDIDATES, MAX_ROWS, GemmPackage, TemplateLinear, pack_weight, unpack_weight
from engine.linear import bf16_matmul_fast

pytestmark = pytest.mark.unit


def test_pack_weight_lays_out_column_blocks_with_row_pairs_interleaved_or_not():
    w = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6).to(torch.bfloat16)   # N = 5, K = 6
    packed = pack_weight(w, block_n=4)
    assert packed.shape == (2, 6, 4) and packed.is_contiguous()
    pairs = packed.view(2, 3, 4, 2)           # [block, K / 2, column in block, row of the pair]
    for n in range(8):
        for k in range(6):
            want = w[n, k] if n < 5 else 0     # columns past N are zero padding
            assert pairs[n // 4, k // 2, n % 4, k % 2] == want
    assert torch.equal(unpack_weight(packed, 5), w)
    plain = pack_weight(w, block_n=4, vnni=False)   # the layout of the micro-kernels without AMX
    assert plain.shape == (2, 6, 4) and plain.is_contiguous()
    for n in range(8):
        for k in range(6):
            assert plain[n // 4, k, n % 4] == (w[n, k] if n < 5 else 0)
    assert torch.equal(unpack_weight(plain, 5, vnni=False), w)
    with pytest.raises(ValueError, match="K even"):
        pack_weight(torch.zeros(4, 5, dtype=torch.bfloat16), 4)
    with pytest.raises(ValueError, match="bfloat16"):
        pack_weight(torch.zeros(4, 6), 4)


@pytest.mark.skipif(not bf16_matmul_fast(),
                    reason="no native bfloat16 matmuls on this CPU: the engine keeps float32 dense copies there")
def test_each_projection_multiplies_by_its_own_weight_through_one_package_per_shape_and_thread_count():
    packages: dict = {}
    gen = torch.Generator().manual_seed(3)
    # N = 80: not a multiple of 32, so some thread counts' micro-kernels read blocks of 16 columns
    weights = [(torch.randn(80, 64, generator=gen) * 0.125).to(torch.bfloat16) for _ in range(2)]
    linears = [TemplateLinear(w, packages) for w in weights]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 5, 64):
                x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
                for lin, w in zip(linears, weights):
                    assert torch.allclose(lin(x).float(), F.linear(x, w).float(), atol=2e-2, rtol=1e-2), (count, rows)
            assert not torch.allclose(linears[0](x).float(), linears[1](x).float(), atol=0.1)   # each its own weight
    finally:
        torch.set_num_threads(threads)
    assert sorted(packages) == [(1, 80, 64), (2, 80, 64)]   # both weights, one package per thread count
    assert all(isinstance(p, GemmPackage) and p.layout in LAYOUT_CANDIDATES for p in packages.values())
    with pytest.raises(ValueError, match="2 to"):
        linears[0](torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        linears[0](torch.zeros(3, 64))
    assert MAX_ROWS >= 64
