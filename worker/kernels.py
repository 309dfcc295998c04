"""A CPU worker's kernels, made ready before it registers: its compiled attention kernels and the
fused operators between the matmuls (`set_attention_kernels`), each built or loaded for every
torch thread count a pass may run on (`pass_thread_counts`), and oneDNN's matmul primitives for
a prompt pass's row buckets (`warm_pass_primitives`). Called by `worker.runtime.build_resources`
once the model and its pool exist."""

from __future__ import annotations

import logging
import time

import torch

from engine.aot_kernel import PackageBusy, defer_busy
from engine.aot_kernel import cache_dir as aot_cache_dir
from engine.flex_prefill import CompiledPrefill
from engine.glue import CompiledGlue
from engine.kv_cache import KVPool
from engine.linear import BUCKET_FROM_ROWS, WARM_BUCKET_ROWS, warm_row_buckets, warm_templates
from engine.paged_decode import CompiledDecode
from engine.prefill_choice import choose_prefill_lengths
from worker.config import WorkerConfig

log = logging.getLogger(__name__)


def set_attention_kernels(config: WorkerConfig, model, pool: KVPool) -> None:
    """A CPU worker's compiled attention kernels (``config.attention_backend`` "compiled" or
    "auto"): a decode worker's decode attention (`engine.paged_decode.CompiledDecode`), and every
    worker's attention of prompt chunks (`engine.flex_prefill.CompiledPrefill`;
    a decode worker runs prompt passes when serving colocated), with the fused operators between
    the matmuls (`engine.glue.CompiledGlue`) where the model's layers take them (``glue_applies``).
    Each is loaded from the disk cache or built now (`engine.aot_kernel`), alone (the others
    detached during its warm-up), once per thread count a pass it serves may run on
    (`pass_thread_counts`), its time logged. Under "auto" the prompt kernel is first timed
    against SDPA (`_prompt_kernel_won`, `engine.prefill_choice`), and kept, and built for its
    other thread counts, only for the chunk lengths it won: where SDPA wins every length, as on
    the AVX2-only EPYCs, a first start builds one package to time and a restart none. When inductor
    cannot build one here (no C++ compiler, say), "compiled" refuses to start (ValueError naming
    the cause) and "auto" logs a warning with the cause and keeps SDPA / the grouped path. CUDA
    pools (Triton), compiled layers (``--no-enforce-eager``) and "grouped" change nothing."""
    if config.attention_backend == "grouped" or config.device != "cpu" or not config.enforce_eager:
        return   # compiled layers attend through their own custom operator
    kernels = [("prefill_kernel", CompiledPrefill, "prompt attention", "SDPA", CompiledPrefill.min_tokens)]
    # the layer operators before decode attention: a prefill worker starting beside this one
    # builds the same packages then, and the two split them (`_warm_counts`)
    if getattr(model, "glue_applies", lambda: False)():
        kernels.append(("glue", CompiledGlue, "layer operators", "eager operators", CompiledGlue.min_rows))
    if config.role == "decode":
        kernels.append(("decode_kernel", CompiledDecode, "decode attention", "grouped", 1))   # min_rows measured
    for attr, kind, what, fallback, shortest in kernels:
        kernel, counts = kind(), pass_thread_counts(config, shortest)
        try:
            if attr == "prefill_kernel" and config.attention_backend == "auto":   # timed first: it may lose
                if not _prompt_kernel_won(config, model, pool, kernel):
                    continue
                chosen, kernel.min_tokens = kernel.min_tokens, shortest   # warmed up from its default length
                seconds = warm_kernel_alone(model, pool, attr, kernel, counts)
                kernel.min_tokens = chosen
            else:
                seconds = warm_kernel_alone(model, pool, attr, kernel, counts)
        except Exception as exc:   # inductor's own errors
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if config.attention_backend == "compiled":
                raise ValueError(f"--attention-backend compiled: the {what} kernel could not be built here "
                                 f"({cause}); use --attention-backend grouped") from exc
            log.warning("%s: %s (--attention-backend auto could not build the compiled kernel here: %s)",
                        what, fallback, cause)
            continue
        _log_ready(what, kernel, seconds, counts)
        if attr == "decode_kernel":
            _measure_decode_rows(config, model, pool, kernel)


def _prompt_kernel_won(config: WorkerConfig, model, pool: KVPool, kernel: CompiledPrefill) -> bool:
    """Under ``--attention-backend auto``, time ``kernel`` against SDPA before building it for
    every thread count (`engine.prefill_choice.choose_prefill_lengths`, its times kept per
    machine): only its package for ``config.threads``, the count it is timed on, is built first,
    and only when no kept times are found. Logs the choice; returns True where the kernel won at
    some length (its ``min_tokens`` set: the caller builds its packages for every count), False
    where SDPA takes every chunk; ``model.prefill_kernel`` is None on return either way.
    Raises inductor's errors where the package cannot be built."""
    def build() -> None:
        seconds = warm_kernel_alone(model, pool, "prefill_kernel", kernel, [config.threads])
        _log_ready("prompt attention", kernel, seconds, [config.threads], " to be timed against SDPA")

    model.prefill_kernel = kernel   # choose_prefill_lengths sets None where SDPA wins every length
    try:
        choice = choose_prefill_lengths(model, kernel, *pool.layer_view(0), config.threads, build=build)
        won = model.prefill_kernel is kernel
    finally:
        model.prefill_kernel = None
    log.info("prompt attention: %s", choice)
    return won


def _log_ready(what: str, kernel, seconds: float, counts, note: str = "") -> None:
    """Log that ``kernel``'s packages for ``counts`` are ready, how many were built and loaded
    (`bench.startup.kernel_builds` reads these lines)."""
    packages = list(kernel.packages.values())
    built = sum(p.built for p in packages)
    log.info("%s: compiled (%s.%s)%s, ready in %.1f s: %d package(s) for thread counts %s, %d built, %d loaded "
             "from %s", what, type(kernel).__module__, type(kernel).__name__, note, seconds, len(packages),
             list(counts), built, len(packages) - built, aot_cache_dir())


def warm_pass_primitives(config: WorkerConfig, model) -> None:
    """Build oneDNN's matmul primitives for every row bucket of a prompt pass up to
    ``max_num_batched_tokens`` or `engine.linear.WARM_BUCKET_ROWS`, the fewer
    (`engine.linear.bucket_rows`), on each thread count such a pass may run on, before the first
    request rather than on the first pass of each bucket (what a build costs: docs/PERFORMANCE.md,
    "A oneDNN primitive per prompt length"); larger buckets build theirs at their first pass. With
    ``--linear-backend template``, the GEMM template's packages for a decode pass's counts too
    (`engine.linear.warm_templates`). Logs the times."""
    t0 = time.perf_counter()
    counts = pass_thread_counts(config, BUCKET_FROM_ROWS + 1)
    rows = min(config.max_num_batched_tokens, WARM_BUCKET_ROWS)
    calls = warm_row_buckets(model.projection_kernels(), rows, counts)
    log.info("projection row buckets: %d matmul primitive(s) built up to %d rows on thread counts %s in %.1f s "
             "(larger buckets at their first pass)", calls, rows, counts, time.perf_counter() - t0)
    if config.linear_backend == "template":   # raises TemplateUnavailable: the worker does not start
        t0, counts = time.perf_counter(), pass_thread_counts(config, 2)
        log.info("linear backend template: %d GEMM template runtime(s) ready on thread counts %s in %.1f s",
                 warm_templates(model.projection_kernels(), counts), counts, time.perf_counter() - t0)


def _measure_decode_rows(config: WorkerConfig, model, pool: KVPool, kernel: CompiledDecode) -> None:
    """Set the decode kernel's ``min_rows`` by timing it against the grouped path on this CPU
    (the model's ``measure_decode_rows``), each batch size on the thread count its pass runs on
    (one below ``parallel_min_tokens``, as `engine.runner.ModelRunner.set_pass_threads`), and
    log the times."""
    times = model.measure_decode_rows(pool, lambda rows: config.threads if rows >= config.parallel_min_tokens else 1)
    log.info("decode attention: compiled from %d row(s) up (measured: %s)", kernel.min_rows,
             ", ".join(f"{rows} row(s) {k * 1e6:.0f} us compiled against {g * 1e6:.0f} us grouped"
                       for rows, (k, g) in times.items()) or "no free block: the default")


KERNEL_ATTRS = ("prefill_kernel", "decode_kernel", "glue")   # a model's compiled kernels


def warm_kernel_alone(model, pool: KVPool, attr: str, kernel, counts: list[int] | tuple[int, ...]) -> float:
    """Set ``model.<attr>`` (one of `KERNEL_ATTRS`) to ``kernel`` and load or build its code by the
    model's ``warm_up`` over ``pool`` on each torch thread count in ``counts`` (inductor's CPU
    code is built for one count: one package each, `engine.aot_kernel`; a count whose package
    another process is building waits its turn, `_warm_counts`), the model's other kernels
    detached meanwhile so that only this one is built; returns the seconds taken. The
    thread count and the other kernels are restored on return. Raises whatever the build raises
    (inductor's errors where it cannot build CPU code), ``model.<attr>`` then None."""
    threads = torch.get_num_threads()
    others = {a: getattr(model, a, None) for a in KERNEL_ATTRS if a != attr}
    setattr(model, attr, kernel)
    for a in others:
        setattr(model, a, None)
    try:
        t0 = time.perf_counter()
        _warm_counts(model, pool, kernel, counts)
        return time.perf_counter() - t0
    except BaseException:
        setattr(model, attr, None)
        raise
    finally:
        torch.set_num_threads(threads)
        for a, other in others.items():
            setattr(model, a, other)


def _warm_counts(model, pool: KVPool, kernel, counts) -> None:
    """``model.warm_up`` over ``pool`` on each torch thread count in ``counts``, in order, except
    that a count whose package another process is building now (`engine.aot_kernel.PackageBusy`
    under `defer_busy`) is left for later while the counts after it are built; when a round over
    those left loads nothing new, the first is warmed waiting for that build. Two workers starting
    together thus split a kernel's packages between them (each built once) rather than both
    building every one. ``kernel.packages`` (its loaded packages by key) tells what a round made.
    Raises what ``warm_up`` raises, `PackageBusy` never."""
    left = list(counts)
    while left:
        made = len(kernel.packages)
        for count in list(left):
            torch.set_num_threads(count)
            try:
                with defer_busy():
                    model.warm_up(pool)
            except PackageBusy:
                continue
            left.remove(count)
        if left and len(kernel.packages) == made:
            torch.set_num_threads(left[0])
            model.warm_up(pool)
            left.pop(0)


def own_thread_counts(config: WorkerConfig) -> tuple[int, ...]:
    """The torch thread counts any pass runs on without a borrowed CPU (`pass_thread_counts`
    from one token, lending left out). Native weights time their low-bit kernel on each
    (`engine.quant.choose_low_bit_plans`), not on a borrowed CPU's count: at start-up that CPU
    is its owner's, loading its own model, so a timing there measures the contention
    (docs/PERFORMANCE.md, "The low-bit kernel timed per pass thread count"); a borrowed pass
    takes the plan of its own count."""
    return tuple(pass_thread_counts(config, 1, borrowing=False))


def pass_thread_counts(config: WorkerConfig, shortest: int, borrowing: bool = True) -> list[int]:
    """The torch thread counts a pass that a compiled kernel serves may run on, the kernel
    taking passes of ``shortest`` tokens and more (`engine.runner.ModelRunner`): ``threads``,
    plus one for each lent CPU it may borrow (with ``borrowing``), and one thread when such a
    pass can be under ``parallel_min_tokens``. Inductor's CPU graphs are built for one thread
    count (torch guards on it), so each kernel is built for each of its counts."""
    lent = len(config.lent_cpus()) if borrowing else 0
    counts = {config.threads + borrowed for borrowed in range(lent + 1)}
    if config.parallel_min_tokens > shortest:
        counts.add(1)
    return sorted(counts)
