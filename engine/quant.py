"""GGUF-native 4-bit weights: the file's Q4_0 / Q4_1 blocks run as a group-wise int4 matmul.

A GGUF Q4_1 block (llama.cpp ``ggml-common.h``, ``block_q4_1``) holds 32 weights of one row as
``d`` (float16 scale), ``m`` (float16 minimum) and 16 bytes of 4-bit codes, element ``j`` in the
low nibble of byte ``j`` and element ``j + 16`` in its high nibble; ``w = d * q + m``. Q4_0
(``block_q4_0``) has no minimum: ``w = d * (q - 8)``. torch's CPU int4 weight-only matmul
(``aten._weight_int4pack_mm_for_cpu``, the kernel torchao's int4 weight-only CPU path calls) takes
the same codes with a per-group ``(scale, zero)`` pair and computes ``w = (q - 8) * scale + zero``
(``aten/src/ATen/native/cpu/int4mm_kernel.cpp``), so both formats map onto it:
``scale = d``, ``zero = m + 8 d`` (Q4_1) or ``0`` (Q4_0). The 4-bit codes are used as stored (no
requantization); the kernel takes each group's scale and zero in the activation dtype, so they
are rounded to bfloat16 (relative error <= 2^-9), as the matmul inputs are.

The kernel is fast for few rows (a matrix-vector product reading half a byte per weight) and slow
for many (it is not blocked over rows). `Int4Linear` therefore keeps, beside the packed codes, the
same weights dequantized once into oneDNN's packed layout and uses that for inputs of more than
``max_int4_rows`` rows (prefill chunks, large decode batches): bfloat16 where the CPU multiplies
bfloat16 natively (AVX512-BF16, AMX), float32 elsewhere (`dense_dtype`). The matmul inputs are cast to
bfloat16 (the kernel's float32 path is a scalar reference loop: docs/PERFORMANCE.md, "The int4
kernel's float32 path"); the outputs come back in the caller's dtype, so the rest of the model
(norms, rotary, attention, the residual stream, the KV pool) stays float32. A model run entirely
in bfloat16 drifts: SmolLM2-135M's greedy answers change (see `engine.config.WEIGHT_MODES`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.linear import Linear, bf16_matmul_fast, median_seconds
from engine.mlas import BLOCK, NBitsMatMul, q8_codes

log = logging.getLogger(__name__)

GROUP_SIZE = BLOCK   # QK4_0 == QK4_1 == 32 in ggml; a Q4_K sub-block is 32 weights too
# GGUF type name -> (bytes per 32-weight block, has a minimum)
_BLOCK = {"Q4_0": (18, False), "Q4_1": (20, True)}
QK_K, Q4_K_BYTES = 256, 144   # ggml-common.h: block_q4_K holds 256 weights in 144 bytes
NATIVE_TYPES = frozenset([*_BLOCK, "Q4_K"])
LOW_BIT_KERNELS = ("int4", "nbits")   # `Int4Linear`'s kernels for few rows


class QuantFormatError(ValueError):
    """A tensor's bytes do not have the shape its GGUF quantization type implies."""


def dense_dtype() -> torch.dtype:
    """The dtype of native mode's dense copies (see `bf16_matmul_fast`)."""
    return torch.bfloat16 if bf16_matmul_fast() else torch.float32


def default_int8_head_rows() -> int:
    """`HeadLinear`'s ``max_int8_rows`` where it is not measured: 8 where its dense copy is
    float32 (the greedy token is then the float32 copy's either way, since ``low_bit``
    recomputes every candidate exactly from the same weights), 4 where it is bfloat16 (whose
    rounding differs from the int8 path's). Measured: docs/PERFORMANCE.md, "The int8 head up to
    eight rows"."""
    return 8 if dense_dtype() == torch.float32 else 4


def int4_kernel_available() -> bool:
    """True when this torch build has the CPU int4 weight-only matmul and it agrees with a
    dequantized float matmul on random data (within bfloat16 tolerance)."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (64, 64), dtype=torch.uint8, generator=gen)
        w = Int4Weight(codes, torch.rand(64, 2, generator=gen) * 0.1, -torch.rand(64, 2, generator=gen) * 0.5)
        x = torch.randn(3, 64, generator=gen)
        lin = Int4Linear(w, max_int4_rows=8, dense_backend="torch")
        y = lin(x)
    except (RuntimeError, NotImplementedError):
        return False
    ref = x.bfloat16().float() @ w.dequantize().T
    return bool(torch.allclose(y, ref, atol=5e-2, rtol=2e-2))


@dataclass
class Int4Weight:
    """Group-wise asymmetric 4-bit weights ``w = scale * q + minimum`` (groups of 32 along a row).

    Attributes:
        codes: ``[out_features, in_features]`` uint8, values 0..15.
        scale: ``[out_features, in_features // 32]`` float32.
        minimum: ``[out_features, in_features // 32]`` float32.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """``[out_features, in_features]`` float32, exactly the values llama.cpp dequantizes."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (q * self.scale[..., None] + self.minimum[..., None]).view(n, k)

    def take_rows(self, index: np.ndarray) -> "Int4Weight":
        """Rows reordered by ``index`` (a permutation of output rows, e.g. undoing the rotary one)."""
        idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
        return Int4Weight(self.codes[idx], self.scale[idx], self.minimum[idx])

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Stack along output rows (fusing Q/K/V or gate/up)."""
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.minimum for p in parts]))

    @staticmethod
    def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> "Int4Weight":
        """Decode a GGUF tensor's raw blocks.

        Args:
            data: the tensor's bytes, ``[rows, bytes_per_row]`` uint8 (``gguf.ReaderTensor.data``).
            type_name: ``"Q4_0"`` or ``"Q4_1"``.
            shape: ``(out_features, in_features)``; ``in_features`` a multiple of 32.
        Raises:
            QuantFormatError: another type, or bytes that do not match the shape.
        """
        if type_name == "Q4_K":
            return Int4Weight._from_q4_k(data, shape)
        if type_name not in _BLOCK:
            raise QuantFormatError(f"{type_name} is not a native 4-bit type ({sorted(NATIVE_TYPES)})")
        block_bytes, has_min = _BLOCK[type_name]
        n, k = shape
        if k % GROUP_SIZE:
            raise QuantFormatError(f"in_features {k} is not a multiple of {GROUP_SIZE}")
        groups = k // GROUP_SIZE
        raw = np.ascontiguousarray(data, dtype=np.uint8)
        if raw.size != n * groups * block_bytes:
            raise QuantFormatError(f"{type_name} tensor of shape {shape} needs {n * groups * block_bytes} bytes, "
                                   f"got {raw.size}")
        blocks = raw.reshape(n, groups, block_bytes)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if has_min:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., 4:]
        else:
            m = -8.0 * d
            qs = blocks[..., 2:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        return Int4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)))

    @staticmethod
    def _from_q4_k(data: np.ndarray, shape: tuple[int, int]) -> "Int4Weight":
        """Q4_K (llama.cpp ``block_q4_K``, ``dequantize_row_q4_K``): a super-block of 256 weights
        is ``d``, ``dmin`` (float16), 12 bytes of eight 6-bit sub-block scales ``sc`` and mins
        ``m`` (``get_scale_min_k4``), and 128 bytes of 4-bit codes: for each 64 weights, 32 bytes
        whose low nibbles are the first 32 and high nibbles the next 32. Weight
        ``w = (d sc) q - (dmin m)`` per 32-weight sub-block: exactly a group-32 ``(scale,
        minimum)`` pair, so it maps onto the int4 kernel as Q4_1 does."""
        n, k = shape
        if k % QK_K:
            raise QuantFormatError(f"Q4_K needs in_features a multiple of {QK_K}, got {k}")
        supers = k // QK_K
        raw = np.ascontiguousarray(data, dtype=np.uint8)
        if raw.size != n * supers * Q4_K_BYTES:
            raise QuantFormatError(f"Q4_K tensor of shape {shape} needs {n * supers * Q4_K_BYTES} bytes, got {raw.size}")
        blocks = raw.reshape(n, supers, Q4_K_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)       # [n, supers]
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        s = blocks[..., 4:16].astype(np.uint8)                                          # [n, supers, 12]
        sc = np.empty(s.shape[:-1] + (8,), np.uint8)
        mn = np.empty_like(sc)
        sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        qs = blocks[..., 16:].reshape(n, supers, 4, 32)                                 # 4 chunks of 64 weights
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)                     # low 32, then high 32
        scale = (d[..., None] * sc).reshape(n, supers * 8).astype(np.float32)
        minimum = (-(dmin[..., None] * mn)).reshape(n, supers * 8).astype(np.float32)
        return Int4Weight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale),
                          torch.from_numpy(minimum))


class Int4Linear:
    """``y = x @ W.T`` for an `Int4Weight`.

    Two low-bit kernels read the 4-bit codes as stored, for inputs of few rows (decode):
    - ``"int4"``: torch's int4 weight-only matmul on bfloat16 inputs (module docstring);
    - ``"nbits"``: onnxruntime's MatMulNBits (`engine.mlas.NBitsMatMul`, 4 bits, zero point 8),
      which rounds each 32-wide block of the input to int8 and multiplies with integer dot
      products, llama.cpp's arithmetic for its Q4 formats (``ggml_vec_dot_q4_1_q8_1``). It computes
      ``x @ (scale (q - 8)).T``; the minimum rides on a second, small product in the same
      session (`engine.mlas.NBitsMatMul`'s ``offset``: ``zero = minimum + 8 scale``,
      ``[out, in / 32]``, times each block's sum of ``x``, in float32; none for Q4_0, whose
      ``zero`` is 0).
    Which one is faster depends on the CPU (docs/PERFORMANCE.md, "MatMulNBits for the 4-bit
    projections") and on the thread count a pass runs on (torch's int4 kernel is parallel over
    torch's threads, MatMulNBits runs on the calling thread): the model times both at load
    (`choose_low_bit_plans`) and keeps one per thread count (`set_plans`) or one for all
    (`keep_kernel`).

    Args:
        weight: the quantized weight, ``[out_features, in_features]``.
        max_int4_rows: inputs with at most this many rows use the low-bit kernel; more rows use
            the dequantized copy (see module docstring). 0: never the low-bit kernel.
        dense_backend: "onednn", "torch" or "template" for the dense copy (`engine.linear`).
        kernels: the low-bit kernels to build, the first one used until `keep_kernel` says
            otherwise (``("int4",)``, ``("nbits",)`` or both, to be timed).
    Call with ``x``: ``[tokens, in_features]`` float32 or bfloat16; returns ``[tokens, out_features]``
    in ``x``'s dtype.
    Raises:
        ValueError: an unknown kernel name.
        RuntimeError: from torch, when this build lacks the int4 kernel (check `int4_kernel_available`).
        engine.mlas.KernelUnavailable: ``"nbits"`` without onnxruntime.
    """

    def __init__(self, weight: Int4Weight, max_int4_rows: int, dense_backend: str,
                 kernels: tuple[str, ...] = ("int4",)):
        if not kernels or set(kernels) - set(LOW_BIT_KERNELS):
            raise ValueError(f"low-bit kernels must be among {LOW_BIT_KERNELS}, got {kernels!r}")
        self.out_features, self.in_features = weight.shape
        self.max_int4_rows = max_int4_rows
        self.kernel = kernels[0]
        self.plans: dict[int, tuple[str, int]] = {}   # torch threads -> (kernel, max rows): `set_plans`
        self._packed = self._scale_zero = self._nbits = None
        zero = weight.minimum + 8.0 * weight.scale   # [out, in / 32]: w = scale (q - 8) + zero; 0 for Q4_0
        if "int4" in kernels:
            # innerKTiles is unused by the CPU packing (kept for the CUDA op's signature)
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
            # [in_features // 32, out_features, 2]
            self._scale_zero = torch.stack([weight.scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
        if "nbits" in kernels:
            self._nbits = NBitsMatMul(weight.codes, weight.scale, bits=4,
                                      offset=zero.numpy() if bool(zero.any()) else None)
        self._dense_dtype = dense_dtype()
        self._dense = Linear(weight.dequantize().to(self._dense_dtype), dense_backend)
        self.dtype = self._dense_dtype   # what its dense path multiplies in (`engine.linear.warm_row_buckets`)

    @property
    def bucketed(self) -> bool:
        """Whether many-row inputs (its dense copy's) run at `engine.linear.bucket_rows`."""
        return self._dense.bucketed

    def set_max_rows(self, rows: int) -> None:
        """Use the low-bit kernel up to ``rows`` rows from now on (at every thread count)."""
        self.max_int4_rows = rows
        self.plans = {n: (kernel, rows) for n, (kernel, _) in self.plans.items()}

    def keep_kernel(self, kernel: str) -> None:
        """Use ``kernel`` (one of those built) for few rows from now on, and free the other.
        Raises:
            ValueError: ``kernel`` was not built."""
        self._check_built(kernel)
        self.kernel = kernel
        self.plans = {n: (kernel, rows) for n, (_, rows) in self.plans.items()}
        self._free_unused({kernel})

    def set_plans(self, plans: dict[int, tuple[str, int]]) -> None:
        """Per torch thread count, the kernel and the most rows it runs (``{threads: (kernel,
        max_rows)}``); a pass on a count not listed takes the plan of the largest listed count
        below it (else the smallest listed). Frees the kernels no plan names.
        Raises:
            ValueError: empty, or a kernel that was not built."""
        if not plans:
            raise ValueError("set_plans needs at least one thread count")
        for kernel, _ in plans.values():
            self._check_built(kernel)
        self.plans = dict(sorted(plans.items()))
        self.kernel, self.max_int4_rows = self.plan_for(torch.get_num_threads())
        self._free_unused({kernel for kernel, _ in plans.values()})

    def plan_for(self, threads: int) -> tuple[str, int]:
        """``(kernel, max_rows)`` for a pass on ``threads`` torch threads (`set_plans`)."""
        if not self.plans:
            return self.kernel, self.max_int4_rows
        below = [n for n in self.plans if n <= threads]
        return self.plans[max(below) if below else min(self.plans)]

    def _check_built(self, kernel: str) -> None:
        if {"int4": self._packed, "nbits": self._nbits}.get(kernel) is None:
            raise ValueError(f"low-bit kernel {kernel!r} was not built")

    def _free_unused(self, used: set[str]) -> None:
        if "nbits" not in used:
            self._nbits = None
        if "int4" not in used:
            self._packed = self._scale_zero = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        kernel, rows = self.plans.get(threads) or self.plan_for(threads)
        if x.shape[0] > rows:
            y = self.dense(x)
        else:
            y = self.int4(x) if kernel == "int4" else self.nbits(x)
        return y.to(x.dtype)

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the low-bit kernel in use (``self.kernel``)."""
        return self.int4(x) if self.kernel == "int4" else self.nbits(x)

    def int4(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through torch's int4 kernel, in bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self._packed,
                                                          GROUP_SIZE, self._scale_zero)

    def nbits(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through MatMulNBits and the minimum's product (class docstring), in float32."""
        return self._nbits(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the dense copy, in `dense_dtype`."""
        return self._dense(x.to(self._dense_dtype).contiguous())

    @property
    def dense_linear(self) -> Linear:
        """The dense copy's `engine.linear.Linear` (`engine.linear.warm_templates`)."""
        return self._dense


class HeadLinear:
    """Native mode's LM head ``y = x @ W.T``: the file's Q8_0 blocks for few rows, a dense copy
    for many.

    The file stores the (tied) embedding as Q8_0 (int8 codes, one float16 scale per 32 weights).
    A decode step of few sequences reads the whole head (49152 x 576 for SmolLM2-135M), so its
    bytes bound the step: inputs of at most ``max_int8_rows`` rows run onnxruntime's 8-bit
    MatMulNBits (`engine.mlas`: int8 activations, integer dot products; faster than torch's
    ``aten._weight_int8pack_mm``, which dequantizes to float; measured: docs/PERFORMANCE.md,
    "Q8_0 head on MatMulNBits") on the Q8_0 codes and scales, recovered exactly from the
    dequantized weight (`engine.mlas.q8_codes`). More rows (prefill, large decode batches, where
    it is slower than a blocked matmul) use a dense copy in `dense_dtype` (bfloat16 rounds
    Q8_0's values ``d * q`` by at most ``|d q| 2^-9 <= 0.25 d``, below Q8_0's own step ``d``).

    The kernel rounds each block of 32 activations to int8 (step ``s = max|x_block| / 127``), so
    a logit moves by at most ``sum_blocks s / 2 * sum_block |w|`` (the activation error times
    the weights' magnitudes), about 0.1 at SmolLM2's logits of ~25: enough to reorder a near tie
    ("What is the capital of France?" answered "L'Etoile..." instead of "The capital...").
    `low_bit` therefore bounds that error for every vocabulary row (per block: a ``[N, K / 32]``
    matrix-vector product) and recomputes exactly, in float32 from the Q8_0 codes, every logit
    whose bound reaches the best lower bound (a few rows of the vocabulary in practice; how many,
    and their cost: docs/PERFORMANCE.md, "Q8_0 head on MatMulNBits"): the greedy token and the
    logits of every token that could be it are then those of a float matmul with the file's
    weights, whatever the int8 rounding did.

    Args:
        weight: ``[out_features, in_features]`` (any float dtype).
        max_int8_rows: inputs with at most this many rows use the int8 kernel; 0: never.
        backend: "onednn", "torch" or "template" for the dense copy (`engine.linear`).
    Call with ``x``: ``[tokens, in_features]`` float32 or bfloat16; returns ``[tokens, out_features]``
    in ``x``'s dtype.
    Raises:
        engine.mlas.KernelUnavailable: onnxruntime missing.
    """

    def __init__(self, weight: torch.Tensor, max_int8_rows: int, backend: str):
        self.out_features, self.in_features = weight.shape
        self.max_int8_rows = max_int8_rows
        codes, scale = q8_codes(weight)
        self._nbits = NBitsMatMul(codes, scale, bits=8)
        n, k = self.out_features, self.in_features
        self._codes, self._scale = codes, scale                    # [N, K] uint8 (q + 128); [N, K / 32] float32
        q = codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.int16) - 128
        # [K / 32, N] float32: sum |w| per block, laid out for one-row products
        self._abs_sums_t = torch.from_numpy(np.ascontiguousarray((np.abs(q).sum(-1) * scale).T, dtype=np.float32))
        self._dtype = dense_dtype()
        self._dense = Linear(weight.to(self._dtype), backend)

    def set_max_rows(self, rows: int) -> None:
        """Use the int8 kernel up to ``rows`` rows from now on; 0 also frees it."""
        self.max_int8_rows = rows
        if rows == 0:
            self._nbits = self._codes = self._scale = self._abs_sums_t = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.low_bit(x) if x.shape[0] <= self.max_int8_rows else self.dense(x)
        return y.to(x.dtype)

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the int8 kernel, in float32, every logit that could be its row's
        largest recomputed exactly (see the class docstring)."""
        y = self._nbits(x)
        xf = x.float().numpy()
        m, k = xf.shape
        # half each block's int8 step: |error of y_n| <= sum_b half_step_b * sum_{k in b} |w_nk|
        half_steps = np.abs(xf.reshape(m, k // GROUP_SIZE, GROUP_SIZE)).max(axis=-1) / np.float32(254.0)
        # matmuls through torch (its thread count): numpy's BLAS would start threads of its own
        bounds = (torch.from_numpy(half_steps * np.float32(1 + 2**-10)) @ self._abs_sums_t).numpy()   # [M, N]
        for r, yr in enumerate(y.numpy()):   # in numpy: a few passes over the vocabulary, no dispatch
            bound = bounds[r]
            # + float32 accumulation slack: 2^-9 of the largest |logit|, besides the bound's own
            slack = np.abs(yr).max() * np.float32(2**-9)
            cols = np.flatnonzero(yr + bound >= (yr - bound).max() - slack)
            w = (self._codes[cols].reshape(-1, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32) - 128.0) \
                * self._scale[cols][..., None]
            yr[cols] = (torch.from_numpy(w.reshape(-1, k)) @ torch.from_numpy(xf[r])).numpy()
        return y

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the dense copy, in `dense_dtype`."""
        return self._dense(x.to(self._dtype).contiguous())


ROW_CANDIDATES = (1, 2, 4, 8, 16, 32)


def measure_max_low_bit_rows(linears: list, candidates: tuple[int, ...] = ROW_CANDIDATES, reps: int = 5) -> int:
    """The most input rows for which the low-bit kernel beats the dense copy, timed on this CPU.

    Whether int4/int8 weight-only kernels (matrix-vector products, reading fewer bytes) beat a
    blocked bfloat16/float32 matmul, and up to how many rows, depends on the CPU, so the threshold
    is measured at load: for each candidate row count in ascending order, the median of ``reps``
    runs of every linear through ``low_bit`` and through ``dense`` (``reps // 2 + 1`` runs above
    8 rows, whose float32 copies on an AVX2 CPU make each run costly); the answer is the last
    count before the first one where ``low_bit`` is not faster (0: never).

    Time what a forward pass runs: every layer's projections in turn, whose weights are out of
    cache when each is met (the dense bfloat16 copies of SmolLM2-135M are 4x the int4 bytes and
    ~7x the L3 cache). Timed on one layer alone, its weights stay cached across the repetitions
    and the dense copy looks better than it is: on the project's AMD EPYC (AVX512-BF16) layer 0
    alone chose fewer rows than the whole step's projections favour. Cost at load for
    SmolLM2-135M: docs/PERFORMANCE.md, "int4 row threshold" and "MatMulNBits for the 4-bit
    projections".

    Args:
        linears: `Int4Linear` or `HeadLinear` objects (anything with ``in_features``,
            ``low_bit(x)`` and ``dense(x)``), timed together, in the order a forward pass runs them.
        candidates: ascending row counts to try.
    Returns:
        A row count from ``candidates``, or 0.
    """
    best = 0
    gen = torch.Generator().manual_seed(0)
    for m in candidates:
        xs = [torch.randn(m, lin.in_features, generator=gen) for lin in linears]
        r = reps if m <= 8 else max(1, reps // 2 + 1)   # the costly runs (an AVX2 CPU's float32 copies) fewer times
        if median_seconds(linears, xs, "low_bit", r) >= median_seconds(linears, xs, "dense", r):
            break
        best = m
    return best


def measure_low_bit_kernel(linears: list, reps: int = 5) -> str:
    """Which of `Int4Linear`'s low-bit kernels runs one-row inputs faster on this CPU: every
    linear in turn, in forward order (weights out of cache, as a decode step meets them), the
    median of ``reps`` runs through each; ties keep ``"int4"``.

    Args:
        linears: `Int4Linear` objects built with both kernels.
    Returns:
        ``"int4"`` or ``"nbits"`` (`LOW_BIT_KERNELS`).
    """
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, lin.in_features, generator=gen) for lin in linears]
    int4 = median_seconds(linears, xs, "int4", reps)
    return "nbits" if median_seconds(linears, xs, "nbits", reps) < int4 else "int4"


def choose_low_bit_plans(linears: list, thread_counts: tuple[int, ...],
                         known: dict[int, tuple[str, int]] | None = None) -> dict[int, tuple[str, int]]:
    """Time `Int4Linear`'s two low-bit kernels and the dense copies on each of ``thread_counts``
    torch threads (`measure_low_bit_kernel`, then `measure_max_low_bit_rows` with the faster
    kernel), give every linear the plans (`Int4Linear.set_plans`), and return them. A worker on N
    threads runs its passes of few tokens on one (`engine.runner.ModelRunner`'s
    ``parallel_min_tokens``), where the faster kernel and its row threshold can differ from N's.
    torch's thread count is restored afterwards. Models load through `engine.tuning`, which
    keeps the plans on disk so that every process on a machine holds the same ones.

    Args:
        linears: `Int4Linear` objects built with both kernels, in forward order.
        thread_counts: the torch thread counts passes run on.
        known: plans already chosen for some of those counts (read back from disk): used, not timed.
    Returns:
        ``{threads: (kernel, max_rows)}``.
    Raises:
        ValueError: no thread count, or one below 1.
    """
    if not thread_counts or min(thread_counts) < 1:
        raise ValueError(f"thread counts must be >= 1, got {thread_counts!r}")
    before = torch.get_num_threads()
    plans = {n: plan for n, plan in (known or {}).items() if n in thread_counts}
    try:
        for threads in sorted(set(thread_counts) - set(plans)):
            torch.set_num_threads(threads)
            kernel = measure_low_bit_kernel(linears)
            for p in linears:
                p.kernel = kernel   # what `measure_max_low_bit_rows` times through ``low_bit``
            plans[threads] = (kernel, measure_max_low_bit_rows(linears))
    finally:
        torch.set_num_threads(before)
    for p in linears:
        p.set_plans(plans)
    return plans
