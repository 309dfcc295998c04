"""Block-quantized weight-only matmuls on onnxruntime's MLAS kernels (``com.microsoft.MatMulNBits``).

Native mode's LM head runs here when few rows come in (decode; `engine.quant.HeadLinear`). The
operator (onnxruntime ``docs/ContribOperators.md``, MatMulNBits) takes ``[N, K]`` weights as
unsigned ``bits``-bit codes in blocks of ``block_size`` along K, one float scale per block and a
zero point, and computes ``Y = A @ W.T`` with ``W = (code - zero_point) * scale``; without a
zero-point input the zero point is ``2^(bits-1)`` (8 for 4 bits, 128 for 8). With
``accuracy_level=4`` MLAS quantizes each block of ``A`` to int8 (one float scale per block) and
multiplies with integer dot products (AVX512-VNNI / AVX-VNNI where the CPU has them, AVX2 or
AVX-512 integer multiply-adds otherwise), as llama.cpp does for its Q8_0 weights. GGUF's Q8_0
(``w = d q``, ``q`` int8, 32 per block) maps onto it exactly: codes ``q + 128``, scale ``d``.

Where it is used (measured: docs/PERFORMANCE.md, "Q8_0 head on MatMulNBits" and "MatMulNBits
for the 4-bit projections"):
- the LM head at one or a few rows: faster than torch's ``aten._weight_int8pack_mm`` (which
  dequantizes every weight to float) and than a bfloat16 dense matmul. Taken.
- the 4-bit projections for few rows (Q4_1's per-block minimum rides on a second small matmul
  of per-block input sums in the same session, ``offset``, since the operator's zero point is an
  integer): where it beats torch's int4 kernel, timed at load (`engine.quant.Int4Linear`,
  `engine.quant.measure_low_bit_kernel`): on AVX2 CPUs, not on an AVX512-BF16 EPYC.
- with more rows MLAS loses to a blocked bfloat16 matmul, so the head keeps a dense copy for those.

`RowInt8MatMul` is the other int8 path measured here and not taken: int8 activations with one
scale per row against int8 weights with one scale per output channel (vLLM's CPU W8A8
scheme), the integer product on onnxruntime's ``MatMulInteger`` (MLAS QGEMM). Its GEMM alone
beats a bfloat16 oneDNN matmul at 32 rows, but quantizing the activations and scaling the int32
result back are separate eager ops that cost more than that gain (`bench.engine --linears`;
measured: docs/PERFORMANCE.md, "Batch 32: native against fp32").

The activations' int8 rounding makes results differ from a float matmul by about 0.5% of the
output's scale (`tests/unit/test_engine_mlas.py` bounds it; llama.cpp's own error is of the
same kind).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32   # QK4_0 == QK4_1 == QK8_0 == 32 in ggml; a Q4_K sub-block is 32 weights too
ACCURACY_INT8 = 4   # MatMulNBits accuracy_level: int8 activations, integer dot products


class KernelUnavailable(RuntimeError):
    """onnxruntime (or its MatMulNBits operator) is not installed or not usable here."""


def _onnx():
    try:
        import onnx
        import onnxruntime
    except ImportError as e:   # both are project dependencies (pyproject.toml)
        raise KernelUnavailable(f"native weights need onnxruntime and onnx ({e}); "
                                "reinstall pdserve's dependencies") from e
    return onnx, onnxruntime


def session_options(threads: int = 1):
    """onnxruntime session options: ``threads`` intra-op threads (default 1: the op runs on the
    calling thread and onnxruntime starts no pool; a worker's other ``--threads`` serve torch),
    no inter-op parallelism, no spinning (an idle worker burns no CPU), no memory arena (nothing
    held beyond the session's weights between calls), warnings only. (Importing
    onnxruntime itself starts one idle library thread, as importing numpy starts OpenBLAS's.)"""
    _, ort = _onnx()
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = False
    so.enable_mem_pattern = False
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def _matmul_session(node, inits: list, a: tuple[int, int], y: tuple[int, int], threads: int):
    """An onnxruntime session running the matmul ``node`` (or a list of nodes, the first one
    naming the graph; weights in ``inits``) from input ``A`` ``[M, a[1]]`` of ONNX element type
    ``a[0]`` to output ``Y`` ``[M, y[1]]`` of type ``y[0]``.
    Raises:
        KernelUnavailable: onnxruntime cannot build or run it here."""
    _, ort = _onnx()
    from onnx import helper

    nodes = node if isinstance(node, list) else [node]
    node = nodes[0]
    graph = helper.make_graph(nodes, node.op_type,
                              [helper.make_tensor_value_info("A", a[0], [None, a[1]])],
                              [helper.make_tensor_value_info("Y", y[0], [None, y[1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    try:
        return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:   # onnxruntime raises its own exception types
        raise KernelUnavailable(f"onnxruntime cannot run {node.op_type} here: {e}") from e


class NBitsMatMul:
    """``y = x @ W.T`` for block-quantized ``W`` through MatMulNBits (see module docstring).

    Args:
        codes: ``[N, K]`` unsigned codes (uint8 array or tensor), below ``2 ** bits``.
        scale: ``[N, K // 32]`` float32, one per block.
        bits: 4 or 8; the zero point is ``2 ** (bits - 1)``: ``W = (code - 2^(bits-1)) * scale``.
        threads: intra-op threads (`session_options`).
        offset: None, or ``[N, K // 32]`` float32 added to every weight of its block:
            ``W = (code - 2^(bits-1)) * scale + offset`` (GGUF Q4_1's minimum; the operator's
            own zero point is an integer). Computed in the same session, exactly in float32:
            ``Y += block_sums(A) @ offset.T``, ``block_sums`` summing each block of ``A``.
    Call with ``x``: ``[M, K]`` (any float dtype; computed from float32); returns ``[M, N]``
    float32.
    Raises:
        KernelUnavailable: onnxruntime missing.
        ValueError: shapes or bits that do not fit.
    """

    def __init__(self, codes, scale, bits: int, threads: int = 1, offset=None):
        _onnx()   # KernelUnavailable before the onnx imports below
        from onnx import TensorProto, helper, numpy_helper

        codes = np.asarray(codes, dtype=np.uint8)
        n, k = codes.shape
        if bits not in (4, 8) or k % BLOCK:
            raise ValueError(f"MatMulNBits here takes 4 or 8 bits and K a multiple of {BLOCK}; got {bits}, K={k}")
        scale = np.ascontiguousarray(np.asarray(scale, dtype=np.float32))
        if scale.shape != (n, k // BLOCK):
            raise ValueError(f"scale shape {scale.shape} != {(n, k // BLOCK)}")
        if int(codes.max(initial=0)) >= 1 << bits:
            raise ValueError(f"codes exceed {bits} bits")
        self.out_features, self.in_features, self.bits = n, k, bits
        if bits == 4:   # two codes per byte, element 2i in the low nibble
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, k // BLOCK, BLOCK // 2)
        else:
            packed = codes.reshape(n, k // BLOCK, BLOCK)
        inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scale.reshape(-1), "S")]
        nodes = [helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y" if offset is None else "Q"],
                                  domain="com.microsoft", K=k, N=n, bits=bits, block_size=BLOCK,
                                  accuracy_level=ACCURACY_INT8)]
        if offset is not None:
            offset = np.asarray(offset, dtype=np.float32)
            if offset.shape != scale.shape:
                raise ValueError(f"offset shape {offset.shape} != {scale.shape}")
            inits += [numpy_helper.from_array(np.array([-1, k // BLOCK, BLOCK], np.int64), "blocks"),
                      numpy_helper.from_array(np.array([2], np.int64), "within"),
                      numpy_helper.from_array(np.ascontiguousarray(offset.T), "offset_t")]
            nodes += [helper.make_node("Reshape", ["A", "blocks"], ["Ab"]),
                      helper.make_node("ReduceSum", ["Ab", "within"], ["sums"], keepdims=0),
                      helper.make_node("MatMul", ["sums", "offset_t"], ["O"]),
                      helper.make_node("Add", ["Q", "O"], ["Y"])]
        self._session = _matmul_session(nodes, inits, (TensorProto.FLOAT, k), (TensorProto.FLOAT, n), threads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().to(torch.float32).contiguous().numpy()
        return torch.from_numpy(self._session.run(["Y"], {"A": a})[0])


def q8_codes(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of 32 along each row of a float weight, quantized as llama.cpp's Q8_0 does
    (``d = max|w| / 127``, ``q = round(w / d)``): ``(codes [N, K] uint8 = q + 128, scale
    [N, K // 32] float32)``. On weights dequantized from a Q8_0 tensor this gives back the
    file's codes and scales exactly (its quantizer maps each block's largest magnitude to
    +-127, and ``127 d / 127`` is exact in float32).
    Raises:
        ValueError: K not a multiple of 32."""
    w = weight.detach().float()
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)[..., None]).clamp_(-127, 127)
    return (q.to(torch.int16) + 128).to(torch.uint8).reshape(n, k).numpy(), d.numpy()


class RowInt8MatMul:
    """``y ~= x @ W.T`` with int8 activations, one scale per row, and int8 weights, one scale per
    output channel (symmetric: ``x ~= s_row * qx``, ``W ~= qw * s_col``), the integer product on
    onnxruntime's ``MatMulInteger`` (ONNX operator; uint8 ``A`` and ``B``, each with zero point
    128; its ``A`` zero point can only be one scalar, so rows are scaled symmetrically). ``B`` is
    uint8, not int8: MLAS's uint8 x int8 kernel on an AVX2 CPU without VNNI multiplies with
    ``vpmaddubsw``, whose int16 pair sums saturate (docs/PERFORMANCE.md, "An AVX2-only EPYC"),
    where its uint8 x uint8 kernel widens to int16 first and is exact.
    A row's result depends on that row alone (no batch-wide scale). Measured, not used by the
    engine (module docstring).

    Args:
        weight: ``[N, K]`` float.
        threads: intra-op threads (`session_options`).
    Call with ``x``: ``[M, K]`` float; returns ``[M, N]`` float32. `quantize` and `gemm` are the
    two halves, for timing the integer product alone.
    Raises:
        KernelUnavailable: onnxruntime missing.
    """

    def __init__(self, weight: torch.Tensor, threads: int = 1):
        _onnx()   # KernelUnavailable before the onnx imports below
        from onnx import TensorProto, helper, numpy_helper

        w = weight.detach().float()
        self.out_features, self.in_features = n, k = w.shape
        self.col_scale = (w.abs().amax(1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        qw = torch.round(w / self.col_scale[:, None]).clamp_(-127, 127).to(torch.int16) + 128
        inits = [numpy_helper.from_array(qw.to(torch.uint8).t().contiguous().numpy(), "B"),
                 numpy_helper.from_array(np.array(128, dtype=np.uint8), "AZ"),
                 numpy_helper.from_array(np.array(128, dtype=np.uint8), "BZ")]
        node = helper.make_node("MatMulInteger", ["A", "B", "AZ", "BZ"], ["Y"])
        self._session = _matmul_session(node, inits, (TensorProto.UINT8, k), (TensorProto.INT32, n), threads)

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """``(codes [M, K] uint8 = round(x / s) + 128, s [M, 1] float32 = max|x_row| / 127)``."""
        x = x.detach().float()
        s = (x.abs().amax(1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        return (torch.round(x / s) + 128).to(torch.uint8).numpy(), s

    def gemm(self, codes: np.ndarray) -> np.ndarray:
        """The integer product alone: ``[M, K]`` uint8 codes -> ``[M, N]`` int32."""
        return self._session.run(["Y"], {"A": codes})[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes, s = self.quantize(x)
        return torch.from_numpy(self.gemm(codes)).float() * s * self.col_scale
