"""A decode step's dense projections: oneDNN's packed weights (the engine's path) against
inductor's C++ GEMM template over frozen weights, beside the rate the core reads the same bytes.

    python -m bench.projections [--threads 1] [--rows 1,8,16,32,64] [--layers 30] [--hidden 576]
                                [--intermediate 1536] [--kv-dim 192] [--reps 7] [--no-graph]
                                [--no-packages] [--json PATH]

Every layer's four projections of a Llama-shaped model (defaults: SmolLM2-135M's, hidden 576,
intermediate 1536, K/V width 192, 30 layers): QKV ``hidden -> hidden + 2 kv_dim``, output
``hidden -> hidden``, gate/up ``hidden -> 2 intermediate``, down ``intermediate -> hidden``, with
random weights in the engine's dense dtype on this CPU
(`engine.quant.dense_dtype`: bfloat16 where the CPU multiplies it natively, else float32), each layer its own (so a step reads them from memory, as a decode step
does), multiplied for each row count in turn by:

- ``onednn``: `engine.linear.Linear` with the oneDNN backend (the weight reordered once into
  oneDNN's blocked layout, `torch.ops.mkldnn._linear_pointwise`): the dense path of the engine's
  projections (`engine.quant.Int4Linear.dense` on a GGUF's 4-bit weights, `Linear` on bfloat16
  checkpoints);
- ``template``: the same multiplies as one ``torch.compile`` graph with the weights as frozen
  constants (``freezing``, ``max_autotune``, GEMM backends ``CPP,ATEN``: inductor picks its C++
  GEMM template, with its own packing of each weight, wherever it times faster than aten's
  call), the row count dynamic (one graph for every count of two or more, its build time
  reported; torch compiles one row as a graph of its own);
- ``package``: `engine.gemm_template.TemplateLinear` per projection: the template built ahead of
  time once per weight shape (AOTInductor) and loaded with each projection's own weight, the form
  the engine can run (bfloat16 weights, two rows and more; the time to load or build the four
  packages and load every weight is reported);
- ``read``: a float32 ``sum`` over a flat copy of the same bytes: the rate one step's weights can
  be read at, the floor of a multiply bound by its weights' bytes.

Milliseconds per step (all layers' projections once; median of ``--reps`` steps, the columns
alternated), the weights' GB/s at that time, and the largest difference between oneDNN's outputs
and the graph's and the packages' (all sum in float32). Prints a table and, with
``--json``, writes it. The template needs inductor's C++ build (a C++ compiler); without one the
build raises inductor's error.
"""

from __future__ import annotations

import contextlib
import time

import torch

from bench.common import arg_parser, median_time, write_json
from engine.gemm_template import TemplateLinear
from engine.linear import Linear, resolve_backend
from engine.quant import dense_dtype


def layer_shapes(hidden: int, intermediate: int, kv_dim: int) -> list[tuple[int, int]]:
    """``[(out_features, in_features)]`` of one layer's four projections (module docstring)."""
    return [(hidden + 2 * kv_dim, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]


class Projections(torch.nn.Module):
    """Every layer's projections as bias-free ``nn.Linear`` modules of ``dtype``;
    ``forward(x_hidden, x_inter)`` multiplies the input whose width is each one's
    ``in_features`` (``[rows, in_features]``, ``dtype``) and returns the ``[rows, out_features]``
    results in layer order."""

    def __init__(self, shapes: list[tuple[int, int]], layers: int, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.lins = torch.nn.ModuleList()
        for _ in range(layers):
            for out_f, in_f in shapes:
                lin = torch.nn.Linear(in_f, out_f, bias=False, dtype=dtype)
                lin.weight.data = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).to(dtype)
                lin.requires_grad_(False)
                self.lins.append(lin)

    def forward(self, x_hidden: torch.Tensor, x_inter: torch.Tensor) -> list[torch.Tensor]:
        return [lin(x_hidden if lin.in_features == x_hidden.shape[1] else x_inter) for lin in self.lins]


@contextlib.contextmanager
def template_settings():
    """Inductor's settings for the template column while the block runs (a row count the
    dynamic graph does not cover, one row, compiles again under them): frozen weights, GEMM
    autotuning over the ``CPP,ATEN`` backends. Restored on exit."""
    import torch._inductor.config as inductor

    saved = (inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends)
    inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends = True, True, "CPP,ATEN"
    try:
        yield
    finally:
        inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends = saved


def bench_projections(shapes: list[tuple[int, int]], layers: int, rows: tuple[int, ...], reps: int,
                      graph: bool = True, packages: bool = True) -> dict:
    """Per row count: ``onednn_ms``, ``read_ms``, with ``graph`` ``template_ms`` and with
    ``packages`` (bfloat16 weights, two rows and more) ``package_ms`` (medians of ``reps`` steps,
    alternated), the weights' GB/s at each (``*_gbps``), and ``template_max_abs_diff`` /
    ``package_max_abs_diff`` from oneDNN's outputs; ``build_s``: the graph's build, ``package_s``:
    making the packages' runtimes (seconds; None when left out), ``weights_bytes``: one step's,
    ``dtype`` theirs.

    Raises RuntimeError where oneDNN's packed linear is unavailable, inductor's errors where it
    cannot build the graph, and `engine.gemm_template.TemplateUnavailable`."""
    if resolve_backend("auto", torch.device("cpu")) != "onednn":
        raise RuntimeError("oneDNN's packed linear is not available on this build/CPU")
    dtype = dense_dtype()
    model = Projections(shapes, layers, dtype)
    packed = [Linear(lin.weight, "onednn") for lin in model.lins]
    nbytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in model.lins)
    flat = torch.cat([lin.weight.flatten() for lin in model.lins]).view(torch.float32)
    hidden, inter = shapes[0][1], shapes[3][1]
    gen = torch.Generator().manual_seed(1)

    def inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(m, hidden, generator=gen).to(dtype), torch.randn(m, inter, generator=gen).to(dtype)

    with torch.inference_mode(), template_settings():
        build_s = package_s = None
        if graph:
            compiled = torch.compile(model)
            xh, xi = inputs(max(2, rows[0]))
            torch._dynamo.mark_dynamic(xh, 0)
            torch._dynamo.mark_dynamic(xi, 0)
            start = time.perf_counter()
            compiled(xh, xi)
            build_s = time.perf_counter() - start
        templates = None
        if packages and dtype == torch.bfloat16:
            start, kept = time.perf_counter(), {}
            templates = [TemplateLinear(lin.weight, kept) for lin in model.lins]
            for t in templates:
                t.warm()
            package_s = time.perf_counter() - start
        out = []
        for m in rows:
            xh, xi = inputs(m)

            def onednn():
                return [p(xh if p.in_features == hidden else xi) for p in packed]

            def package():
                return [t(xh if t.in_features == hidden else xi) for t in templates]

            steps = {"onednn": onednn, "read": flat.sum}
            if graph:
                steps["template"] = lambda: compiled(xh, xi)
            if templates is not None and m >= 2:
                steps["package"] = package
            ref = onednn()
            row = {"rows": m}
            for name in ("template", "package"):
                if name in steps:
                    row[f"{name}_max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                                      for a, b in zip(ref, steps[name]()))
            spent = {name: [] for name in steps}
            for rep in range(reps):
                order = list(steps) if rep % 2 == 0 else list(reversed(steps))
                for name in order:
                    spent[name].append(median_time(steps[name], 1, warmup=1 if rep == 0 else 0))
            for name, seconds in spent.items():
                ms = sorted(seconds)[len(seconds) // 2] * 1e3
                row[f"{name}_ms"], row[f"{name}_gbps"] = ms, nbytes / ms / 1e6
            out.append(row)
    return {"dtype": str(dtype).removeprefix("torch."), "weights_bytes": nbytes, "build_s": build_s,
            "package_s": package_s, "rows": out}


def main(argv=None) -> dict:
    ap = arg_parser("bench.projections", __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv-dim", type=int, default=192)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-graph", action="store_true", help="leave out the torch.compile graph column")
    ap.add_argument("--no-packages", action="store_true", help="leave out the packages column")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = layer_shapes(args.hidden, args.intermediate, args.kv_dim)
    result = bench_projections(shapes, args.layers, tuple(int(r) for r in args.rows.split(",")), args.reps,
                               graph=not args.no_graph, packages=not args.no_packages)
    built = [f"template graph built in {result['build_s']:.1f} s" if result["build_s"] is not None else "",
             f"packages made in {result['package_s']:.1f} s" if result["package_s"] is not None else ""]
    print(f"threads={args.threads}  cpu={torch.backends.cpu.get_cpu_capability()}  {args.layers} layers, "
          f"{result['weights_bytes'] / 1e6:.1f} MB of {result['dtype']} weights a step; " + "; ".join(b for b in built if b))
    names = ("onednn", "template", "package", "read")
    print(f"{'rows':>5} " + " ".join(f"{n + ' ms':>12} {'GB/s':>6}" for n in names) + f" {'graph diff':>10} {'pkg diff':>9}")
    for r in result["rows"]:
        cells = [(f"{r[n + '_ms']:>12.2f} {r[n + '_gbps']:>6.2f}" if n + "_ms" in r else f"{'-':>12} {'-':>6}") for n in names]
        diffs = [f"{r[k]:>{w}.2e}" if k in r else f"{'-':>{w}}" for k, w in (("template_max_abs_diff", 10),
                                                                               ("package_max_abs_diff", 9))]
        print(f"{r['rows']:>5} " + " ".join(cells) + " " + " ".join(diffs))
    result["threads"] = args.threads
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
