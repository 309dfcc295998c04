"""Matrix multiply kernels for the model's projections (``y = x @ W.T``).

Three backends:
- ``onednn``: the weight is reordered once into oneDNN's blocked layout and multiplied with
  ``torch.ops.mkldnn._linear_pointwise`` (the kernels PyTorch's inductor uses for CPU linears).
  On a single core this runs faster than ``F.linear`` for multi-row inputs and for the LM head
  (measured: docs/PERFORMANCE.md, "Linear kernels").
- ``torch``: plain ``F.linear``; the portable choice (CUDA tensors, builds without oneDNN).
- ``template``: ``onednn``, and for bfloat16 weights (a model's layer projections; its LM head
  and routed experts stay on ``onednn``, `engine.models.llama.LlamaModel`) a second copy packed for inductor's C++ GEMM
  template (`engine.gemm_template.TemplateLinear`), which multiplies inputs of 2 to
  `TEMPLATE_MAX_ROWS` rows (decode steps; prompt passes stay on oneDNN, faster there). Opt-in
  (``--linear-backend template``): the copy doubles the dense weights' memory, and each weight
  shape's package is built once per thread count (measured: docs/PERFORMANCE.md, "A step's
  projections through inductor's GEMM template").

``auto`` picks ``onednn`` for CPU weights when the ops exist and a self-check on random data agrees
with ``F.linear`` within float tolerance, else ``torch``; the choice is logged. bfloat16 weights
on a CPU without native bfloat16 matmuls (AVX2: oneDNN refuses to pack them) use ``torch``.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
BACKENDS = ("auto", "onednn", "torch", "template")
TEMPLATE_PACKAGES: dict = {}
"""The ``template`` backend's packages (`engine.gemm_template.GemmPackage` by ``(threads, out,
in)``), shared by every `Linear` of the process."""


BUCKET_FROM_ROWS = 64
"""Row counts above this are padded to a bucket (`bucket_rows`) before a oneDNN multiply."""
WARM_BUCKET_ROWS = 512
"""A worker builds its row buckets' primitives at start-up up to this many rows
(`worker.kernels.warm_pass_primitives`), the larger ones at the first pass that meets each: their
warm-up is mostly the multiplies that build them rather than the builds, and a build adds little
to the pass that meets it first (measured: docs/PERFORMANCE.md, "Row buckets warmed up to 512
rows")."""
TEMPLATE_MAX_ROWS = BUCKET_FROM_ROWS
"""The ``template`` backend multiplies inputs of 2 to this many rows through its template copy."""


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN multiply of ``rows`` rows runs at: ``rows`` up to
    `BUCKET_FROM_ROWS`, else ``rows`` rounded up to a multiple of an eighth of its power of two
    (at least 16): 300 -> 320, 1100 -> 1152. At most 1/8 of the rows are padding (zero rows, whose
    outputs are dropped), and prompt chunks up to 8192 tokens take 52 buckets.

    Why: oneDNN builds (JIT-compiles) a matmul primitive for each shape it meets, the row count
    included, and caches it (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; oneDNN's "Primitive Cache"
    documentation). Prompt chunks of every length each built four (a layer's projections) per
    thread count on every pass of a chat workload's spread of lengths
    (measured: docs/PERFORMANCE.md, "A oneDNN primitive per prompt length"). Decode batches (up to
    `BUCKET_FROM_ROWS` rows) keep their own sizes: few, and all cached."""
    if rows <= BUCKET_FROM_ROWS:
        return rows
    step = max(16, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


def warm_row_buckets(kernels: list, max_rows: int, counts) -> int:
    """Build oneDNN's primitives for every row bucket above `BUCKET_FROM_ROWS` up to
    ``max_rows``'s, by one multiply of zeros through each of ``kernels`` (one layer's
    projections: `Linear`, `engine.quant.Int4Linear`, whose many-row path is a bucketed `Linear`;
    each with ``in_features``, ``dtype`` and ``bucketed``; those not ``bucketed``, off oneDNN,
    are skipped) at each bucket, on each torch thread count in ``counts`` (a primitive is built
    for one count); returns the multiplies run. The thread count is restored on return. A
    primitive serves every weight of its shape, so one layer's kernels warm every layer. Raises
    what a kernel raises (oneDNN's RuntimeError)."""
    kernels = [k for k in kernels if k.bucketed]
    threads, calls = torch.get_num_threads(), 0
    buckets = sorted({bucket_rows(r) for r in range(BUCKET_FROM_ROWS + 1, max_rows + 1)})
    try:
        for count in counts:
            torch.set_num_threads(count)
            for rows in buckets:
                for kernel in kernels:
                    kernel(torch.zeros(rows, kernel.in_features, dtype=kernel.dtype))
                    calls += 1
    finally:
        torch.set_num_threads(threads)
    return calls


def warm_templates(kernels: list, counts) -> int:
    """Make the ``template`` backend's runtimes of ``kernels`` (one layer's projections:
    `Linear`, or kernels whose ``dense_linear`` is one, `engine.quant.Int4Linear`) on each torch
    thread count in ``counts``, loading or building each weight shape's package (a package serves
    every weight of its shape; the other layers' runtimes are made at their first call); returns
    how many were made. The thread count is restored on return. Raises
    `engine.gemm_template.TemplateUnavailable`."""
    threads, made = torch.get_num_threads(), 0
    linears = [getattr(k, "dense_linear", k) for k in kernels]
    try:
        for count in counts:
            torch.set_num_threads(count)
            for lin in linears:
                if isinstance(lin, Linear) and lin.template is not None:
                    lin.warm_template()
                    made += 1
    finally:
        torch.set_num_threads(threads)
    return made


def onednn_available() -> bool:
    """True when this torch build has oneDNN's packed-weight linear ops and they are correct."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        w, x = torch.randn(64, 32), torch.randn(3, 32)
        packed = ops._reorder_linear_weight(w, None)
        y = ops._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), atol=1e-4, rtol=1e-4))


def bf16_matmul_fast() -> bool:
    """True when oneDNN has native bfloat16 matmuls on this CPU (AVX512-BF16 or AMX); without
    them a bfloat16 matmul is emulated and slower than float32, so dense copies stay float32."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_backend(name: str, device: torch.device) -> str:
    """Map ``auto`` to a concrete backend. Raises ValueError for an unknown or unusable name."""
    if name not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "onednn" if device.type == "cpu" and onednn_available() else "torch"
        log.info("linear backend: %s", name)
    elif name == "onednn" and (device.type != "cpu" or not onednn_available()):
        raise ValueError("linear backend 'onednn' needs CPU weights and a torch build with oneDNN")
    elif name == "template" and (device.type != "cpu" or not onednn_available() or not bf16_matmul_fast()):
        raise ValueError("linear backend 'template' needs CPU weights, a torch build with oneDNN and a CPU "
                         "with native bfloat16 matmuls (AVX512-BF16 or AMX)")
    return name


class Linear:
    """A projection ``y = x @ W.T``.

    Args:
        weight: ``[out_features, in_features]``.
        backend: "onednn", "torch" or "template" (already resolved; "template" on a float32
            weight is "onednn").
        gemv_copy: with ``onednn`` and float32 weights, also keep ``weight`` as is and multiply
            one-row inputs (a decode step of one sequence) with ``F.linear`` (MKL's sgemv),
            faster than oneDNN's packed kernel for one row on some CPUs, slower on others
            (`gemv_copy_pays` decides; docs/PERFORMANCE.md, "Linear kernels"), at the cost of a
            second copy of the weight (none when ``weight`` is also held elsewhere, e.g. a tied
            embedding).
    Call with ``x``: ``[tokens, in_features]``, same dtype; returns ``[tokens, out_features]``
    (with ``onednn``, above `BUCKET_FROM_ROWS` rows, a contiguous view of the first ``tokens`` rows
    of a `bucket_rows` result: `packed`). With ``template``, the first call on a thread count
    makes the template's runtime for it and may build its package (`engine.gemm_template`; raises
    `engine.gemm_template.TemplateUnavailable` where it cannot); `warm_template` does it ahead.
    """

    def __init__(self, weight: torch.Tensor, backend: str, gemv_copy: bool = False):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self._plain = self.template = None
        if backend == "template":
            if weight.dtype == torch.bfloat16 and bf16_matmul_fast():
                from engine.gemm_template import TemplateLinear

                self.template = TemplateLinear(weight, TEMPLATE_PACKAGES)
            backend = "onednn"
        if backend == "onednn" and weight.dtype == torch.bfloat16 and not bf16_matmul_fast():
            # oneDNN refuses to pack bfloat16 without AVX512-BF16/AVX-NE-CONVERT (AVX2 CPUs)
            backend = "torch"
        self.backend = backend
        if backend == "onednn":
            self._w = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            if gemv_copy and weight.dtype == torch.float32:
                self._plain = weight.contiguous()
        else:
            self._w = weight

    @property
    def bucketed(self) -> bool:
        """Whether many-row inputs run at `bucket_rows` (the oneDNN backend)."""
        return self.backend == "onednn"

    @property
    def has_gemv_copy(self) -> bool:
        return self._plain is not None

    def drop_gemv_copy(self) -> None:
        """Multiply one-row inputs with the packed weight too, and free the plain copy."""
        self._plain = None

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through oneDNN's packed weight, whatever the row count: above
        `BUCKET_FROM_ROWS` rows, ``x`` padded with zero rows to `bucket_rows` and the result's
        first rows returned (a contiguous view)."""
        rows = x.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(x, self._w, None, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._w, None, "none", [], "")

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the plain copy (``F.linear``); needs `has_gemv_copy`."""
        return F.linear(x, self._plain)

    def warm_template(self) -> None:
        """With a template copy: make its runtime for the current thread count now (building
        the package if the cache lacks it). Raises `engine.gemm_template.TemplateUnavailable`."""
        if self.template is not None:
            self.template.warm()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.template is not None and 2 <= x.shape[0] <= TEMPLATE_MAX_ROWS:
            return self.template(x)
        if self.backend == "onednn":
            if self._plain is not None and x.shape[0] == 1:
                return F.linear(x, self._plain)
            return self.packed(x)
        return F.linear(x, self._w)


def gemv_copy_pays(linears: list[Linear], reps: int = 5) -> bool:
    """Whether one-row inputs run faster through the plain copies (MKL's sgemv via ``F.linear``)
    than through oneDNN's packed weights, timed on this CPU over ``linears`` together (median of
    ``reps`` runs each way, after one warm-up).

    Measured, not assumed: the plain copy won on one core of earlier AVX2 and AVX-512 machines
    and lost on the project's AMD EPYC (AVX512-BF16) (docs/PERFORMANCE.md, "Linear kernels").

    Args:
        linears: float32 `Linear` objects that hold a gemv copy.
    """
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, lin.in_features, generator=gen) for lin in linears]
    return median_seconds(linears, xs, "gemv", reps) < median_seconds(linears, xs, "packed", reps)


def median_seconds(linears: list, xs: list[torch.Tensor], path: str, reps: int) -> float:
    """Seconds to run ``getattr(lin, path)(x)`` for every pair of ``linears`` and ``xs`` in turn:
    the median of ``reps`` runs after one warm-up run (the kernel-choice timings at load)."""
    runs = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for lin, x in zip(linears, xs):
            getattr(lin, path)(x)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:])
