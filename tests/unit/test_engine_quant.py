"""Native 4-bit weights (engine/quant.py): GGUF Q4_0 / Q4_1 blocks decode to exactly the values
the ``gguf`` package (llama.cpp's own Python reference) dequantizes, and the int4 kernel and the
dense fallback both compute ``x @ W.T`` within bfloat16 tolerance."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine import config as engine_config
from engine.config import CacheConfig, ModelConfig, compatibility_hash, weights_dtype
from engine.quant import HeadLinear, Int4Linear, Int4Weight, QuantFormatError, dense_dtype, int4_kernel_available

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not int4_kernel_available(),
                                reason=f"torch {torch.__version__} has no working CPU int4 kernel")
# (onnxruntime, which the LM head needs, is a dependency: its absence fails, not skips)


def _quantized(kind, n=48, k=96, seed=0):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, kind), (n, k)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
def test_gguf_blocks_decode_to_the_reference_values(kind):
    data, shape = _quantized(kind)
    w = Int4Weight.from_gguf(data, kind.name, shape)
    assert w.codes.dtype == torch.uint8 and int(w.codes.max()) <= 15 and w.scale.shape == (48, 3)
    ref = gguf.quants.dequantize(data, kind)
    assert np.array_equal(w.dequantize().numpy(), ref)


def test_rows_reorder_and_stack_like_the_dense_tensors():
    data, shape = _quantized(T.Q4_1)
    w = Int4Weight.from_gguf(data, "Q4_1", shape)
    perm = np.random.default_rng(1).permutation(shape[0])
    dense = w.dequantize()
    assert torch.equal(w.take_rows(perm).dequantize(), dense[torch.from_numpy(perm)])
    assert torch.equal(Int4Weight.cat([w, w.take_rows(perm)]).dequantize(),
                       torch.cat([dense, dense[torch.from_numpy(perm)]]))


def test_bad_blocks_are_refused():
    data, shape = _quantized(T.Q4_1)
    with pytest.raises(QuantFormatError):
        Int4Weight.from_gguf(data[:, :-1], "Q4_1", shape)   # a byte short per row
    with pytest.raises(QuantFormatError):
        Int4Weight.from_gguf(data, "Q8_0", shape)
    with pytest.raises(QuantFormatError):
        Int4Weight.from_gguf(data, "Q4_1", (shape[0] * 2, shape[1] // 2))   # 48 is not a multiple of 32


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_int4_and_dense_paths_compute_the_same_product(rows, backend):
    from engine.linear import onednn_available

    if backend == "onednn" and not onednn_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    data, shape = _quantized(T.Q4_1, n=96, k=128)
    w = Int4Weight.from_gguf(data, "Q4_1", shape)
    x = torch.randn(rows, 128)
    ref = x.bfloat16().float() @ w.dequantize().T
    for max_rows in (0, 64):   # dense copy, int4 kernel
        y = Int4Linear(w, max_rows, backend)(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 96)
        torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2)




@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
@pytest.mark.parametrize("rows", [1, 5])
def test_nbits_kernel_computes_the_product_with_the_minimum(kind, rows):
    """MatMulNBits (int8 activations per 32-wide block) plus the minimum's block-sum product
    equals a float matmul with the file's weights within int8 rounding; Q4_0 has no minimum term.
    Without the minimum's product the Q4_1 result is off (the check can fail)."""
    data, shape = _quantized(kind, n=96, k=128)
    w = Int4Weight.from_gguf(data, kind.name, shape)
    lin = Int4Linear(w, 64, "torch", kernels=("nbits",))
    assert lin.kernel == "nbits" and lin._packed is None

    x = torch.randn(rows, 128)
    ref = x @ w.dequantize().T
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert float((y - ref).norm() / ref.norm()) < 1e-2
    if kind == T.Q4_1:   # without the minimum's product the result is off
        from engine.mlas import NBitsMatMul

        no_min = NBitsMatMul(w.codes, w.scale, bits=4)
        assert float((no_min(x) - ref).norm() / ref.norm()) > 0.1


def test_keep_kernel_frees_the_other_and_refuses_one_not_built():
    data, shape = _quantized(T.Q4_1, n=96, k=128)
    w = Int4Weight.from_gguf(data, "Q4_1", shape)
    x = torch.randn(2, 128)
    both = Int4Linear(w, 64, "torch", kernels=("int4", "nbits"))
    assert both.kernel == "int4" and torch.equal(both(x), both.int4(x).float())
    both.keep_kernel("nbits")
    assert both._packed is None and both._scale_zero is None and torch.equal(both(x), both.nbits(x))
    with pytest.raises(ValueError, match="not built"):
        both.keep_kernel("int4")
    with pytest.raises(ValueError, match="low-bit kernels"):
        Int4Linear(w, 64, "torch", kernels=("int8",))
    with pytest.raises(ValueError, match="low-bit kernels"):
        Int4Linear(w, 64, "torch", kernels=())

@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_lm_head_int8_and_dense_paths_agree_with_the_weights(backend):
    from engine.linear import onednn_available

    if backend == "onednn" and not onednn_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    data, shape = _quantized(T.Q8_0, n=200, k=128)
    w = torch.from_numpy(gguf.quants.dequantize(data, T.Q8_0))
    head = HeadLinear(w, max_int8_rows=4, backend=backend)
    for rows in (1, 4, 5, 9):   # the Q8_0 kernel up to 4 rows (int8 activations), dense copy above
        x = torch.randn(rows, 128)
        y = head(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 200)
        ref = x @ w.T
        if rows <= 4:
            assert float((y - ref).norm() / ref.norm()) < 1e-2
            assert not torch.equal(y, head.dense(x).float())   # not the dense copy
            # the int8 activations' error never decides the best token: it and its logit are exact
            assert torch.equal(y.argmax(-1), ref.argmax(-1))
            torch.testing.assert_close(y.max(-1).values, ref.max(-1).values, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(y, head.dense(x).float())
    head.set_max_rows(0)
    assert head._nbits is None and torch.equal(head(x[:1]), head.dense(x[:1]).float())


def test_lm_head_near_ties_are_decided_by_the_exact_logits():
    """Logits a few hundredths apart (a near tie, as SmolLM2 meets on "What is the capital of
    France?"): the kernel's int8 activations alone get the order wrong in some of these rows;
    the exact recomputation of every contender gets every row right."""
    gen = torch.Generator().manual_seed(5)
    k = 128
    data, shape = _quantized(T.Q8_0, n=64, k=k, seed=5)
    w = torch.from_numpy(gguf.quants.dequantize(data, T.Q8_0))
    head = HeadLinear(w, max_int8_rows=4, backend="torch")
    raw_wrong = 0
    for _ in range(50):
        x = torch.randn(1, k, generator=gen) * 20
        ref = (x.double() @ w.double().T)[0]
        top2 = ref.topk(2)
        if float(top2.values[0] - top2.values[1]) > 0.05:
            # move row 1 to within 0.01 of the best: a near tie
            x = x + (float(top2.values[0] - top2.values[1]) - 0.01) * (w[top2.indices[1]] - w[top2.indices[0]]) \
                / float((w[top2.indices[1]] - w[top2.indices[0]]).double().pow(2).sum())
            ref = (x.double() @ w.double().T)[0]
        y = head(x)[0]
        assert int(y.argmax()) == int(ref.argmax())
        raw_wrong += int(head._nbits(x)[0].argmax()) != int(ref.argmax())
    assert raw_wrong > 0   # the test meets ties the int8 kernel alone gets wrong


def test_weights_modes_and_the_compatibility_hash():
    assert [weights_dtype(m) for m in ("fp32", "bf16", "native")] == ["float32", "bfloat16", "float32"]
    from deploy.launcher import WEIGHT_MODES
    assert WEIGHT_MODES == engine_config.WEIGHT_CHOICES   # the torch-free copy agrees
    with pytest.raises(ValueError):
        weights_dtype("int4")
    cfg = ModelConfig(name="m", vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position=64, tie_word_embeddings=True)
    cache = CacheConfig()
    # same pool dtype, different K/V: a native prefill must not feed an fp32 decode worker
    assert compatibility_hash(cfg, cache, "native") != compatibility_hash(cfg, cache, "fp32")


def test_one_row_inputs_take_the_plain_float32_copy_and_agree():
    from engine.linear import Linear, onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    w = torch.randn(96, 64)
    lin = Linear(w, "onednn", gemv_copy=True)
    assert lin._plain is not None and lin._plain.data_ptr() == w.data_ptr()   # no copy made
    assert Linear(w.bfloat16(), "onednn", gemv_copy=True)._plain is None      # float32 only
    for rows in (1, 2, 7):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), x @ w.T, atol=1e-4, rtol=1e-4)


def test_without_native_bfloat16_the_kernels_fall_back_instead_of_failing():
    """On an AVX2 CPU oneDNN refuses to pack bfloat16 weights and bfloat16 attention is slow:
    bfloat16 linears use F.linear, and ``--weights bf16`` (every matmul emulated, ~5x slower than
    fp32) is refused with a clear error rather than served slowly. Emulated here by
    capping oneDNN and ATen at AVX2 in a child process (a no-op on a real AVX2 machine)."""
    import os
    import subprocess
    import sys

    code = """
import torch
from engine.linear import Linear, bf16_matmul_fast
assert not bf16_matmul_fast()
w = torch.randn(64, 32).bfloat16()
lin = Linear(w, "onednn")
assert lin.backend == "torch", lin.backend
x = torch.randn(3, 32).bfloat16()
torch.testing.assert_close(lin(x), x @ w.T)
from engine.loader import load_model
try:
    load_model(weights="bf16")
except ValueError as exc:
    assert "natively" in str(exc), exc
else:
    raise AssertionError("bf16 weights loaded on a CPU without native bfloat16")
print("ok")
"""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_native_weights_without_native_bfloat16_attend_in_float32_and_answer():
    import os
    import subprocess
    import sys

    code = """
import torch
from engine.loader import build_generator, load_model
from engine.sampling import SamplingParams
torch.set_num_threads(1)
m = load_model(weights="native")
assert (m.model.kv_dtype, m.model.attn_dtype) == (torch.bfloat16, torch.float32)
tk = m.tokenizer
ids = tk.encode(tk.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
gen = build_generator(m)
[out] = gen.generate([ids], SamplingParams(max_tokens=12, temperature=0))
assert "Paris" in out.text and gen.num_free_blocks == gen.pool.allocator.num_blocks, out.text
print("ok")
"""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_q4_k_blocks_decode_to_the_reference_values():
    rng = np.random.default_rng(3)
    n, k = 16, 512   # the int4 kernel packs rows in 16s
    blocks = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    for col, scale in ((0, 0.01), (2, 0.02)):   # finite float16 d and dmin
        blocks[..., col:col + 2] = np.full(blocks.shape[:2], scale, np.float16)[..., None].view(np.uint8)
    data = blocks.reshape(n, -1)
    w = Int4Weight.from_gguf(data, "Q4_K", (n, k))
    assert w.scale.shape == (n, k // 32) and int(w.codes.max()) <= 15
    ref = gguf.quants.dequantize(data, T.Q4_K)
    np.testing.assert_allclose(w.dequantize().numpy(), ref, rtol=1e-6, atol=1e-7)
    with pytest.raises(QuantFormatError, match="multiple of 256"):
        Int4Weight.from_gguf(data[:, :144], "Q4_K", (n, 256 - 32))
    x = torch.randn(2, k)
    y = Int4Linear(w, max_int4_rows=8, dense_backend="torch")(x)     # through the int4 kernel
    want = x.bfloat16().float() @ torch.from_numpy(ref).T
    assert float((y - want).norm() / want.norm()) < 1e-2   # bfloat16 scales, zeros and inputs


class _TimedPaths:
    """A stand-in linear whose two paths cost a known time per call (a fake: the real kernels'
    speeds cannot be set, and the rule under test is only which row counts it keeps)."""

    in_features = 8

    def __init__(self, low_bit_s_per_row: float, dense_s: float):
        self.low_bit_s_per_row, self.dense_s = low_bit_s_per_row, dense_s

    def low_bit(self, x):
        time.sleep(self.low_bit_s_per_row * x.shape[0])

    def dense(self, x):
        time.sleep(self.dense_s)


def test_low_bit_rows_are_those_before_the_first_row_count_where_it_loses():
    from engine.quant import measure_max_low_bit_rows

    # the low-bit path costs 1 ms per row, the dense copy 3 ms whatever the rows: wins at 1 and 2
    assert measure_max_low_bit_rows([_TimedPaths(1e-3, 3e-3)], reps=3) == 2
    assert measure_max_low_bit_rows([_TimedPaths(4e-3, 3e-3)], reps=3) == 0    # never
    assert measure_max_low_bit_rows([_TimedPaths(1e-5, 3e-3)], reps=3) == 32   # every candidate


def test_measured_thresholds_apply_to_every_projection():
    """The real kernels, timed on this CPU: whatever low-bit kernel and row count are chosen,
    every 4-bit projection of the model uses them, and inputs up to the rows take the low-bit
    kernel, above them the dense copy. Timed on each thread count the loader is given."""
    from engine.loader import load_model

    m = load_model(weights="native", low_bit_threads=(1, 2))
    assert set(m.model.low_bit_plans) == {1, 2}
    assert all(p.plans == m.model.low_bit_plans for lin in m.model._layers for p in vars(lin).values()
               if isinstance(p, Int4Linear))
    rows = m.model.max_int4_rows
    assert rows in (0, 1, 2, 4, 8, 16, 32)
    # the head's rows are not timed: 8 over a float32 dense copy, 4 over a bfloat16 one
    assert m.model._lm_head.max_int8_rows == (8 if dense_dtype() == torch.float32 else 4)
    assert {p.max_int4_rows for lin in m.model._layers for p in vars(lin).values()
            if isinstance(p, Int4Linear)} == {rows}
    wo = m.model._layers[0].wo
    # the low-bit kernel timed faster at one row, the same for every projection, one no plan names freed
    assert m.model.low_bit_kernel in ("int4", "nbits")
    assert {p.kernel for lin in m.model._layers for p in vars(lin).values()
            if isinstance(p, Int4Linear)} == {m.model.low_bit_kernel}
    kept = {kernel for kernel, _ in m.model.low_bit_plans.values()}
    assert (wo._packed is None) == ("int4" not in kept) and (wo._nbits is None) == ("nbits" not in kept)
    for n in {max(rows, 1), rows + 1}:
        x = torch.randn(n, wo.in_features)
        want = wo.low_bit(x) if n <= rows else wo.dense(x)
        assert torch.equal(wo(x), want.to(x.dtype))


def test_threshold_is_timed_over_every_layers_projections_in_forward_order(monkeypatch, tmp_path):
    """`max_int4_rows` is timed on the projections a step runs, all of them in turn (their
    weights out of cache), not on one layer kept hot by the repetitions: layer 0 alone made the
    bfloat16 copies look faster than they are (engine.quant.measure_max_low_bit_rows)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # no kept plan (engine.tuning): timed
    import engine.models.llama
    import engine.quant
    from engine.loader import load_model

    timed = []

    def fake_measure(linears, candidates=(1, 2, 4, 8), reps=5):   # records what would be timed
        timed.append(list(linears))
        return 2 if isinstance(linears[0], Int4Linear) else 4

    monkeypatch.setattr(engine.quant, "measure_max_low_bit_rows", fake_measure)      # the projections'
    monkeypatch.setattr(engine.models.llama, "measure_max_low_bit_rows", fake_measure)   # the head's
    m = load_model(weights="native").model
    forward_order = [p for lin in m._layers for p in (lin.wqkv, lin.wo, lin.w_gate_up, lin.w_down)]
    assert len(timed) == 1 and timed[0] == forward_order     # the head's threshold is given (4)
    assert len(forward_order) == 4 * m.config.num_layers
    assert m.max_int4_rows == 2 and {p.max_int4_rows for p in forward_order} == {2}


def test_each_pass_thread_count_takes_its_own_measured_kernel_and_rows():
    """A worker on N threads runs its few-token passes on one (`ModelRunner`'s
    ``parallel_min_tokens``): the low-bit kernel and its row threshold are timed on 1 and on N
    threads, and every call follows the plan of the thread count it runs on."""
    from engine.quant import choose_low_bit_plans

    data, shape = _quantized(T.Q4_1, n=64, k=128)
    linears = [Int4Linear(Int4Weight.from_gguf(data, "Q4_1", shape), 0, "torch", kernels=("int4", "nbits"))
               for _ in range(4)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plans = choose_low_bit_plans(linears, (2, 1))
        assert torch.get_num_threads() == 2   # restored
        assert set(plans) == {1, 2}
        assert all(k in ("int4", "nbits") and r in (0, 1, 2, 4, 8, 16, 32) for k, r in plans.values())
        assert all(p.plans == plans for p in linears)
        lin = linears[0]
        assert (lin._nbits is None) == ("nbits" not in {k for k, _ in plans.values()})
        # the plans themselves, set by hand: nbits up to 8 rows on one thread, int4 up to 2 on two
        both = [Int4Linear(Int4Weight.from_gguf(data, "Q4_1", shape), 0, "torch", kernels=("int4", "nbits"))]
        lin = both[0]
        lin.set_plans({1: ("nbits", 8), 2: ("int4", 2)})
        x = torch.randn(4, shape[1])
        for threads, want in ((1, lin.nbits(x)), (2, lin.dense(x)), (3, lin.dense(x))):   # 3: two's plan
            torch.set_num_threads(threads)
            assert torch.equal(lin(x), want.to(x.dtype)), threads
        torch.set_num_threads(2)
        assert torch.equal(lin(x[:2]), lin.int4(x[:2]).to(x.dtype))
        assert lin.plan_for(1) == ("nbits", 8) and lin.plan_for(5) == ("int4", 2)
        lin.set_plans({2: ("int4", 2)})   # the other kernel freed
        assert lin._nbits is None and lin.plan_for(1) == ("int4", 2)
        with pytest.raises(ValueError):
            lin.set_plans({1: ("nbits", 8)})   # freed: not built any more
        with pytest.raises(ValueError):
            choose_low_bit_plans(linears, ())
    finally:
        torch.set_num_threads(before)
