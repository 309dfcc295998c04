"""Inductor's C++ GEMM template for a model's bfloat16 projections at decode-sized row counts,
built ahead of time once per weight shape and loaded with each projection's own weight.

The template (``torch._inductor.codegen.cpp_gemm_template``, its AMX or AVX-512 micro-kernels)
multiplies a decode step's projections faster than oneDNN's packed linear on an AMX core (measured:
``python -m bench.projections``, docs/PERFORMANCE.md "A step's projections through inductor's GEMM
template"), but inductor offers it only for a weight that is a constant of the graph (``freezing``),
which it packs at build time, and AOTInductor's runtime constant folding does not build with it
(torch 2.13.0). So here a package is built per ``(out_features, in_features)`` and thread count
with a random weight as its constant, and every projection of that shape loads the same package
(`engine.aot_kernel`) with its own weight as a user-managed constant
(``AOTIModelPackageLoader.load_constants``: the tensor is used in place, not copied), packed here
in the layout the template packs its constant into (`pack_weight`). Which layout the package's
micro-kernel reads (its ``block_n``, and whether row pairs are interleaved: the AMX kernels'
VNNI2, or not: the AVX-512 kernel without AMX, which converts to float32) depends on the kernel
inductor picked; `GemmPackage` finds it once per package by loading a known weight packed each
candidate way and comparing the product with ``F.linear``; a package none of them matches is
refused (`TemplateUnavailable`), never run.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.aot_kernel import load_or_build

MAX_ROWS = 4096
"""The most rows a package multiplies (the exported row dimension's bound); at least 2."""
BLOCK_N_CANDIDATES = (32, 16, 64, 48)
"""Column-block widths the template's micro-kernels pack their weight in (register blocking)."""
LAYOUT_CANDIDATES = tuple((block_n, vnni) for vnni in (True, False) for block_n in BLOCK_N_CANDIDATES)
"""``(block_n, vnni)`` layouts `GemmPackage` tries, in order: row pairs interleaved (the AMX
micro-kernels' ``LayoutType.VNNI2``) or not (``LayoutType.NORMAL``: ``CppMicroGemmFP32Vec``, the
AVX-512 and AVX2 kernels; source: ``torch._inductor.codegen.cpp_micro_gemm``, torch 2.13.0)."""


class TemplateUnavailable(RuntimeError):
    """The template cannot serve this weight here: no package could be built or none of the packed
    layouts `pack_weight` writes reproduces its product."""


def pack_weight(weight: torch.Tensor, block_n: int, vnni: bool = True) -> torch.Tensor:
    """``weight`` ``[N, K]`` bfloat16 (K even) in the template's constant layout for a ``block_n``
    micro-kernel: ``W.T`` with its columns padded with zeros to a multiple of ``block_n``, cut into
    ``[K, block_n]`` blocks, and with ``vnni`` within each block the rows taken in pairs
    interleaved (VNNI2, the order bfloat16 dot-product instructions read):
    ``[ceil(N / block_n), K, block_n]``, contiguous.
    Source: ``CppGemmTemplate.block_weight`` and ``pack_vnni_weight`` (torch 2.13.0). Raises
    ValueError for a weight that is not 2-D bfloat16 with an even K."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        raise ValueError(f"pack_weight takes a [N, K] bfloat16 weight with K even, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    blocks = -(-n // block_n)
    wt = F.pad(weight.t(), (0, blocks * block_n - n))                      # [K, N padded]
    blocked = wt.reshape(k, blocks, block_n).transpose(0, 1)               # [blocks, K, block_n]
    if not vnni:
        return blocked.contiguous()
    return blocked.reshape(blocks, k // 2, 2, block_n).transpose(2, 3).contiguous().view(blocks, k, block_n)


def unpack_weight(packed: torch.Tensor, out_features: int, vnni: bool = True) -> torch.Tensor:
    """The ``[out_features, K]`` weight `pack_weight` packed into ``packed``
    (``[blocks, K, block_n]``, row pairs interleaved or not by ``vnni``): the inverse
    permutation, the padding columns dropped."""
    blocks, k, block_n = packed.shape
    wt = packed.view(blocks, k // 2, block_n, 2).transpose(2, 3).reshape(blocks, k, block_n) if vnni else packed
    return wt.transpose(0, 1).reshape(k, blocks * block_n)[:, :out_features].t().contiguous()


class _Projection(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _template_codegen():
    import torch._inductor.config as inductor

    return inductor.patch({"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
                           "aot_inductor.package_constants_in_so": False})


class GemmPackage:
    """The template's package for ``[out_features, in_features]`` bfloat16 weights on the current
    torch thread count (inductor writes its parallel loops for one): loaded from the cache or built
    (`engine.aot_kernel.load_or_build`), then the weight layout it reads found: ``layout``,
    ``(block_n, vnni)`` of `LAYOUT_CANDIDATES` (module docstring).

    Raises:
        TemplateUnavailable: inductor could not build it (no C++ compiler, no template for this
            CPU or shape), or no candidate layout reproduces ``F.linear``.
    """

    def __init__(self, out_features: int, in_features: int):
        self.out_features, self.in_features = out_features, in_features

        def export():
            example = torch.zeros(2, in_features, dtype=torch.bfloat16)
            module = _Projection(torch.randn(out_features, in_features).to(torch.bfloat16)).eval()
            rows = torch.export.Dim("rows", min=2, max=MAX_ROWS)
            with torch.no_grad():
                return torch.export.export(module, (example,), dynamic_shapes=({0: rows},))

        try:
            package = load_or_build("gemm_template", {"out": out_features, "in": in_features},
                                    [__file__], export, _template_codegen)
        except Exception as exc:   # inductor's and export's own errors, many types
            raise TemplateUnavailable(f"GEMM template for {out_features}x{in_features}: {exc}") from exc
        self.path: Path = package.path
        self.built, self.seconds = package.built, package.seconds
        self.layout = self._find_layout()

    def loader(self, packed: torch.Tensor):
        """A runtime of this package multiplying by the weight whose `pack_weight` in ``layout``
        (``(block_n, vnni)``) is ``packed`` (kept alive by the caller: the runtime reads it in place)."""
        loader = torch._C._aoti.AOTIModelPackageLoader(str(self.path), "model", False, 1, -1)
        constants = {}
        for name in loader.get_constant_fqns():
            constants[name] = packed if name != "weight" else torch.empty(0, dtype=torch.bfloat16)
        loader.load_constants(constants, False, False, True)
        return loader

    def _find_layout(self) -> tuple[int, bool]:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(self.out_features, self.in_features, generator=gen).to(torch.bfloat16)
        x = torch.randn(3, self.in_features, generator=gen).to(torch.bfloat16)
        want = F.linear(x, weight).float()
        for layout in LAYOUT_CANDIDATES:
            packed = pack_weight(weight, *layout)
            try:
                got = self.loader(packed).run([x])[0].float()
            except RuntimeError:
                continue
            if torch.allclose(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02):
                return layout
        raise TemplateUnavailable(f"GEMM template for {self.out_features}x{self.in_features}: no packed "
                                  f"layout of {LAYOUT_CANDIDATES} (block_n, vnni) reproduces F.linear")


class TemplateLinear:
    """``y = x @ W.T`` through the template for 2 to `MAX_ROWS` rows of bfloat16: one weight
    ``[out_features, in_features]`` bfloat16 (K even), kept only packed (`pack_weight`, at
    `LAYOUT_CANDIDATES`' first; a package that reads another layout gets a copy repacked for
    it, `unpack_weight`), with one runtime per thread count (``packages``, shared by every projection of
    the process: `GemmPackage` by ``(threads, out, in)``), made at the first call on that count or
    by `warm` beforehand.

    Call with ``x`` ``[rows, in_features]`` bfloat16 (made contiguous), ``2 <= rows <= MAX_ROWS``;
    returns ``[rows, out_features]`` bfloat16. Raises ValueError for other rows or dtypes, and
    `TemplateUnavailable` from the first call on a thread count whose package cannot serve.
    """

    def __init__(self, weight: torch.Tensor, packages: dict[tuple[int, int, int], GemmPackage]):
        if weight.dim() != 2 or weight.dtype != torch.bfloat16:
            raise ValueError(f"TemplateLinear takes a 2-D bfloat16 weight, got {tuple(weight.shape)} {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self._packed = {LAYOUT_CANDIDATES[0]: pack_weight(weight, *LAYOUT_CANDIDATES[0])}
        self._packages = packages
        self._loaders: dict[int, object] = {}

    def warm(self) -> None:
        """Make this thread count's runtime now (building its package if the cache lacks it)."""
        self._loader()

    def _loader(self):
        threads = torch.get_num_threads()
        loader = self._loaders.get(threads)
        if loader is None:
            key = (threads, self.out_features, self.in_features)
            package = self._packages.get(key)
            if package is None:
                package = self._packages[key] = GemmPackage(self.out_features, self.in_features)
            packed = self._packed.get(package.layout)
            if packed is None:
                first, kept = next(iter(self._packed.items()))
                packed = self._packed[package.layout] = pack_weight(
                    unpack_weight(kept, self.out_features, first[1]), *package.layout)
            loader = self._loaders[threads] = package.loader(packed)
        return loader

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"TemplateLinear({self.out_features}x{self.in_features}) takes [rows, "
                             f"{self.in_features}] bfloat16, got {tuple(x.shape)} {x.dtype}")
        if not 2 <= x.shape[0] <= MAX_ROWS:
            raise ValueError(f"TemplateLinear multiplies 2 to {MAX_ROWS} rows, got {x.shape[0]}")
        return self._loader().run([x.contiguous()])[0]
