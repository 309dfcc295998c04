"""`worker.kernels`'s choice of a CPU worker's attention kernels (``--attention-backend``): a
decode worker's compiled decode kernel and every worker's compiled prompt kernel, built at
start-up for each thread count a pass may take, and what happens where inductor cannot build
them (a fault injected by replacing a kernel's class with one that fails as a missing C++
compiler would)."""

from __future__ import annotations

import json
import logging
import time

import pytest

import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.flex_prefill import CompiledPrefill
from engine.paged_decode import CompiledDecode
from engine.kv_cache import KVPool
from tests.unit.test_engine_runner import TINY, _model
from worker.config import WorkerConfig
from worker.kernels import own_thread_counts, pass_thread_counts, set_attention_kernels

pytestmark = pytest.mark.unit

SLOWER = 0.02
"""Seconds an injected slowness adds to each call: above any gap between the kernel and SDPA at
the timed lengths on the tiny model (the kernel was 4 ms slower at 1024 tokens on an AMX core)."""


class _NoCompiler(CompiledDecode):
    """Injected fault: the first call fails as inductor does without a C++ compiler."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found (injected)")


class _NoCompilerPrefill(CompiledPrefill):
    """Injected fault, as `_NoCompiler`, for the prompt kernel."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found (injected)")


class _RecordsThreads:
    """Mixed into a real kernel: records the torch thread count of each call."""

    def __init__(self):
        super().__init__()
        self.thread_counts = []

    def __call__(self, *args, **kwargs):
        self.thread_counts.append(torch.get_num_threads())
        return super().__call__(*args, **kwargs)


class _Counting(_RecordsThreads, CompiledPrefill):
    """The real prompt kernel, recording thread counts."""


class _CountingDecode(_RecordsThreads, CompiledDecode):
    """The real decode kernel, recording thread counts."""


class _RowsAndThreads(CompiledDecode):
    """The real decode kernel, recording (rows, torch thread count) of each call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, q, *args, **kwargs):
        self.calls.append((q.shape[0], torch.get_num_threads()))
        return super().__call__(q, *args, **kwargs)


@pytest.fixture()
def model_and_pool():
    return _model(5), KVPool(TINY, CacheConfig(block_size=4, num_blocks=16))


@pytest.fixture(autouse=True)
def tuning_dir(tmp_path, monkeypatch):
    """Kept timings (`engine.tuning.kept_timings`) in the test's own directory: a test's injected
    slowness is timed, never read back from the machine's (or kept there)."""
    directory = tmp_path / "pdserve-tuning"
    monkeypatch.setattr("engine.tuning.tuning_dir", lambda: directory)
    return directory


def test_auto_and_compiled_build_the_kernels_and_grouped_does_not(model_and_pool, caplog):
    model, pool = model_and_pool
    set_attention_kernels(WorkerConfig(role="decode", attention_backend="grouped"), model, pool)
    assert model.decode_kernel is None and model.prefill_kernel is None
    set_attention_kernels(WorkerConfig(role="prefill", attention_backend="compiled"), model, pool)
    assert model.decode_kernel is None and isinstance(model.prefill_kernel, CompiledPrefill)
    model.prefill_kernel = None
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="decode", attention_backend="auto"), model, pool)
    assert isinstance(model.decode_kernel, CompiledDecode)
    assert "decode attention: compiled" in caplog.text and "prompt attention: compiled" in caplog.text
    # auto then times the prompt kernel against SDPA: kept from a length up, or dropped (next test)
    assert "prompt attention: compiled from" in caplog.text or (
        model.prefill_kernel is None and "prompt attention: SDPA at every length" in caplog.text)
    assert pool.allocator.num_free == pool.allocator.num_blocks   # the warm-up gave its blocks back


def test_each_kernel_is_built_alone_for_each_thread_count_its_passes_may_take(model_and_pool, monkeypatch):
    """A worker with one thread that may borrow one lent CPU runs prompt passes on one or two
    threads: the prompt kernel is called (built) at both; more lent CPUs, more counts; a second
    thread for long passes only (``parallel_min_tokens`` above the kernel's shortest prompt)
    adds one thread. A decode worker of two threads runs decode steps under
    ``parallel_min_tokens`` rows on one thread and longer ones on two: its decode kernel is
    built at both, and neither kernel's warm-up calls the other."""
    model, pool = model_and_pool
    monkeypatch.setattr("worker.kernels.CompiledPrefill", _Counting)
    monkeypatch.setattr("worker.kernels.CompiledDecode", _CountingDecode)
    before = torch.get_num_threads()
    config = WorkerConfig(role="prefill", attention_backend="compiled", cpu_board="/tmp/board", borrow_cpus="1")
    set_attention_kernels(config, model, pool)
    assert model.prefill_kernel.thread_counts == [1, 1, 2, 2] and model.decode_kernel is None   # 2 a count
    assert sorted(key[0] for key in model.prefill_kernel.packages) == [1, 2]   # one package a count
    assert torch.get_num_threads() == before
    model.prefill_kernel = None
    set_attention_kernels(WorkerConfig(role="decode", attention_backend="compiled", threads=2), model, pool)
    assert model.prefill_kernel.thread_counts == [2, 2]
    assert sorted(set(model.decode_kernel.thread_counts)) == [1, 2]   # once a layer
    assert sorted(key[0] for key in model.decode_kernel.packages) == [1, 2]
    assert torch.get_num_threads() == before
    shortest = CompiledPrefill.min_tokens
    assert pass_thread_counts(WorkerConfig(role="prefill", borrow_cpus="2,3", cpu_board="/tmp/board"),
                               shortest) == [1, 2, 3]
    assert pass_thread_counts(WorkerConfig(role="decode", threads=2), shortest) == [2]
    assert pass_thread_counts(WorkerConfig(role="decode", threads=2, parallel_min_tokens=1024), shortest) == [1, 2]
    assert pass_thread_counts(WorkerConfig(role="decode", threads=2), CompiledDecode.min_rows) == [1, 2]
    assert pass_thread_counts(WorkerConfig(role="decode", threads=2, parallel_min_tokens=0),
                               CompiledDecode.min_rows) == [2]
    # native weights time their low-bit kernel on the worker's own counts, never a borrowed CPU's
    assert own_thread_counts(WorkerConfig(role="decode", borrow_cpus="0", cpu_board="/tmp/board")) == (1,)
    assert own_thread_counts(WorkerConfig(role="decode", threads=2)) == (1, 2)
    assert own_thread_counts(WorkerConfig(role="decode", threads=2, parallel_min_tokens=1)) == (2,)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_where_a_kernel_cannot_be_built_auto_keeps_the_eager_path_and_compiled_refuses(
        model_and_pool, monkeypatch, caplog, role):
    model, pool = model_and_pool
    monkeypatch.setattr("worker.kernels.CompiledDecode", _NoCompiler)
    monkeypatch.setattr("worker.kernels.CompiledPrefill", _NoCompilerPrefill)
    with caplog.at_level(logging.WARNING, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role=role, attention_backend="auto"), model, pool)
    assert model.decode_kernel is None and model.prefill_kernel is None
    assert "prompt attention: SDPA" in caplog.text and "No working C++ compiler" in caplog.text
    assert ("decode attention: grouped" in caplog.text) == (role == "decode")
    with pytest.raises(ValueError, match="--attention-backend compiled: the .* kernel could not be built"):
        set_attention_kernels(WorkerConfig(role=role, attention_backend="compiled"), model, pool)
    assert model.decode_kernel is None and model.prefill_kernel is None
    assert pool.allocator.num_free == pool.allocator.num_blocks


def test_the_kernels_build_with_torchs_isa_detection_unless_told_otherwise():
    """No probe libraries built and loaded in child processes when a package is built
    (`engine.aot_kernel.configure_inductor`); an explicit ``TORCHINDUCTOR_VEC_ISA_OK`` (inductor's
    ``cpp.vec_isa_ok``) is kept. Inductor's own ``patch`` sets and restores the option: pytest's
    monkeypatch would delete it on undo (it cannot read the old value off inductor's config
    proxy), hiding it from later tests."""
    import torch._inductor.config as inductor_config

    from engine.aot_kernel import configure_inductor

    with inductor_config.patch({"cpp.vec_isa_ok": None, "compile_threads": 2}):
        configure_inductor()
        assert inductor_config.cpp.vec_isa_ok is True and inductor_config.compile_threads == 1
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        configure_inductor()
        assert inductor_config.cpp.vec_isa_ok is False


def test_the_decode_kernels_min_rows_is_the_fewest_rows_it_was_faster_from():
    """`faster_from`: the fewest rows from which the kernel was faster at every timed row count;
    a slower count above keeps the rows below it on the grouped path; nothing timed, the default."""
    from engine.paged_decode import faster_from

    fast, slow = (1.0, 2.0), (2.0, 1.0)
    assert faster_from({1: fast, 2: fast, 3: fast}, 4) == 1
    assert faster_from({1: slow, 2: fast, 3: fast}, 4) == 2
    assert faster_from({1: fast, 2: slow, 3: fast}, 4) == 3
    assert faster_from({1: fast, 2: fast, 3: slow}, 4) == 4
    assert faster_from({1: (1.0, 1.0), 2: fast, 3: fast}, 4) == 2   # a tie stays grouped
    assert faster_from({}, 4) == 4 and faster_from({5: slow}, 4) == 4


def test_a_decode_worker_sets_its_kernels_min_rows_by_timing_it_on_each_rows_thread_count(
        model_and_pool, monkeypatch, caplog):
    """A decode worker of two threads times its decode kernel against the grouped path at 1, 2
    and 3 rows on one thread (under ``parallel_min_tokens``, as those passes run) or two (at or
    above it), through the built package; ``min_rows`` is what those times support, logged with
    them, and the blocks the timing took are back in the pool."""
    from engine.paged_decode import ROW_CANDIDATES, faster_from

    model, pool = model_and_pool
    measured = []
    real = model.measure_decode_rows

    def measure(pool, threads_for):
        measured.append(real(pool, threads_for))
        return measured[-1]

    monkeypatch.setattr(model, "measure_decode_rows", measure)
    monkeypatch.setattr("worker.kernels.CompiledDecode", _RowsAndThreads)
    before = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="decode", attention_backend="auto", threads=2,
                                            parallel_min_tokens=3), model, pool)
    (times,) = measured
    assert sorted(times) == list(ROW_CANDIDATES) and all(k > 0 and g > 0 for k, g in times.values())
    kernel = model.decode_kernel
    assert kernel.min_rows == faster_from(times, CompiledDecode.min_rows)
    assert f"decode attention: compiled from {kernel.min_rows} row(s) up (measured: 1 row(s)" in caplog.text
    assert {(rows, threads) for rows, threads in kernel.calls if rows < 4} == {(1, 1), (2, 1), (3, 2)}
    assert sorted({key[0] for key in kernel.packages}) == [1, 2]   # no package built by the timing
    assert torch.get_num_threads() == before and pool.allocator.num_free == pool.allocator.num_blocks


def test_the_prompt_kernel_is_kept_from_the_fewest_tokens_it_was_faster_from():
    """`kernel_from`: the fewest timed tokens from which the kernel was faster at every longer
    length; slower (or tied) at the longest, or nothing timed: None (SDPA everywhere)."""
    from engine.prefill_choice import kernel_from

    fast, slow = (1.0, 2.0), (2.0, 1.0)
    assert kernel_from({128: fast, 256: fast, 512: fast}) == 128
    assert kernel_from({128: slow, 256: fast, 512: fast}) == 256
    assert kernel_from({128: fast, 256: slow, 512: fast}) == 512
    assert kernel_from({128: fast, 256: fast, 512: slow}) is None
    assert kernel_from({128: fast, 512: (1.0, 1.0)}) is None and kernel_from({}) is None


class _SlowPrefill(CompiledPrefill):
    """Injected fault: the real prompt kernel, made slower than SDPA by a sleep in each call."""

    def __call__(self, *args, **kwargs):
        time.sleep(SLOWER)
        return super().__call__(*args, **kwargs)


def _slow_sdpa(real):
    """Injected fault: torch's SDPA made slower than the kernel by a sleep in each call."""

    def sdpa(*args, **kwargs):
        time.sleep(SLOWER)
        return real(*args, **kwargs)
    return sdpa


@pytest.mark.parametrize("slower", ["kernel", "sdpa"])
def test_auto_keeps_the_prompt_kernel_only_where_it_was_timed_faster(model_and_pool, monkeypatch, caplog, slower):
    """Under ``--attention-backend auto`` a worker times its prompt kernel against SDPA at
    `MEASURE_LENGTHS` on its pass thread count: a kernel slower at every length is dropped (SDPA
    for every chunk), one faster at every length is kept from its default length; "compiled"
    keeps it untimed. The thread count is restored."""
    from engine.prefill_choice import MEASURE_LENGTHS

    model, pool = model_and_pool
    if slower == "kernel":
        monkeypatch.setattr("worker.kernels.CompiledPrefill", _SlowPrefill)
    else:
        monkeypatch.setattr("engine.attention.F.scaled_dot_product_attention",
                            _slow_sdpa(torch.nn.functional.scaled_dot_product_attention))
    before = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto", threads=2), model, pool)
    assert torch.get_num_threads() == before
    timed = [m for m in caplog.messages if m.startswith("prompt attention: ") and "measured on 2 thread(s)" in m]
    assert len(timed) == 1 and all(f"{n} tokens " in timed[0] for n in MEASURE_LENGTHS)
    if slower == "kernel":
        assert model.prefill_kernel is None and "SDPA at every length" in timed[0]
    else:
        assert model.prefill_kernel.min_tokens == CompiledPrefill.min_tokens
        assert f"compiled from {CompiledPrefill.min_tokens} tokens up" in timed[0]
    model.prefill_kernel = None
    set_attention_kernels(WorkerConfig(role="prefill", attention_backend="compiled"), model, pool)
    assert model.prefill_kernel.min_tokens == CompiledPrefill.min_tokens


class _SlowCounting(_RecordsThreads, _SlowPrefill):
    """The slowed prompt kernel (`_SlowPrefill`), recording thread counts."""


@pytest.mark.parametrize("slower", ["kernel", "sdpa"])
def test_auto_builds_the_prompt_kernel_for_its_other_thread_counts_only_where_it_won(
        model_and_pool, monkeypatch, caplog, slower):
    """A prefill worker of one thread that may borrow a lent CPU runs prompt passes on one or two
    threads. Under ``auto`` its prompt kernel is built for one thread, the count it is timed on,
    and timed; only a kernel that won is then built for two, and warmed up from its default
    length; one that lost is never built for two. A restart that reads the kept times back
    builds no package to time: none at all where SDPA won, both where the kernel did."""
    from engine.prefill_choice import MEASURE_LENGTHS

    model, pool = model_and_pool
    monkeypatch.setattr("worker.kernels.CompiledPrefill", _Counting if slower == "sdpa" else _SlowCounting)
    if slower == "sdpa":
        monkeypatch.setattr("engine.attention.F.scaled_dot_product_attention",
                            _slow_sdpa(torch.nn.functional.scaled_dot_product_attention))
    config = WorkerConfig(role="prefill", attention_backend="auto", cpu_board="/tmp/board", borrow_cpus="1")
    assert pass_thread_counts(config, CompiledPrefill.min_tokens) == [1, 2]
    for start in ("first", "restart"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="worker.kernels"):
            set_attention_kernels(config, model, pool)
        ready = [m for m in caplog.messages if m.startswith("prompt attention: compiled (")]
        if slower == "kernel":
            assert model.prefill_kernel is None and "SDPA at every length" in caplog.text
            assert [" to be timed against SDPA" in m for m in ready] == ([True] if start == "first" else [])
            assert all("1 package(s) for thread counts [1]," in m for m in ready)   # never built for two
            continue
        kernel = model.prefill_kernel
        assert kernel.min_tokens == CompiledPrefill.min_tokens and "compiled from 128 tokens up" in caplog.text
        assert sorted(key[0] for key in kernel.packages) == [1, 2]
        assert "2 package(s) for thread counts [1, 2]" in ready[-1]
        first_on_two = kernel.thread_counts.index(2)
        if start == "first":   # built on one thread and timed there (6 calls a length) before two
            assert len(ready) == 2 and first_on_two > 6 * len(MEASURE_LENGTHS)
        else:                  # times read back: one warm-up a count, nothing timed
            assert len(ready) == 1 and kernel.thread_counts == [1] * first_on_two + [2] * first_on_two
        model.prefill_kernel = None
    assert pool.allocator.num_free == pool.allocator.num_blocks


def test_the_prompt_choice_is_timed_once_per_machine_and_read_back_by_later_starts(model_and_pool, monkeypatch,
                                                                                  caplog, tuning_dir):
    """The first ``auto`` start times the prompt kernel and keeps the times; a later start with a
    kernel that would lose every timing (injected slowness) reads them back instead, takes the
    same path and logs where the times came from; a kept file that cannot be read is named, timed
    again and replaced; another thread count, or another kernel class, is timed on its own."""
    model, pool = model_and_pool
    monkeypatch.setattr("engine.attention.F.scaled_dot_product_attention",
                        _slow_sdpa(torch.nn.functional.scaled_dot_product_attention))
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto"), model, pool)
    (kept,) = tuning_dir.glob("prompt-attention-*.json")
    first = json.loads(kept.read_text())["times"]
    assert sorted(map(int, first)) == [128, 256, 512, 1024] and f"timed and kept in {tuning_dir}" in caplog.text
    assert model.prefill_kernel.min_tokens == CompiledPrefill.min_tokens   # SDPA was the slower
    monkeypatch.undo()   # SDPA its own speed again; the kernel made slower, its class the same
    monkeypatch.setattr("engine.tuning.tuning_dir", lambda: tuning_dir)
    real = CompiledPrefill.__call__

    def slow(self, *args, **kwargs):
        time.sleep(SLOWER)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(CompiledPrefill, "__call__", slow)
    model.prefill_kernel = None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto"), model, pool)
    assert f"read from {tuning_dir}" in caplog.text and "compiled from 128 tokens up" in caplog.text
    assert model.prefill_kernel is not None and json.loads(kept.read_text())["times"] == first
    kept.write_text(json.dumps({"times": {"128": [1.0, 2.0]}}))   # lengths missing: timed again
    model.prefill_kernel = None
    caplog.clear()
    with caplog.at_level(logging.INFO):
        set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto"), model, pool)
    assert str(kept) in caplog.text and "not used, timed again" in caplog.text
    assert model.prefill_kernel is None and "SDPA at every length" in caplog.text   # the slow kernel, timed
    assert sorted(map(int, json.loads(kept.read_text())["times"])) == [128, 256, 512, 1024]
    set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto", threads=2), model, pool)
    monkeypatch.setattr("worker.kernels.CompiledPrefill", _SlowPrefill)   # another kernel: its own times
    set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto"), model, pool)
    assert len(list(tuning_dir.glob("prompt-attention-*.json"))) == 3


def test_bfloat16_prompt_attention_is_offered_only_over_a_bfloat16_pool_on_a_native_bfloat16_cpu(monkeypatch):
    """`prompt_low_dtype`: never for a float32 pool (the reference mode); over a bfloat16 pool,
    bfloat16 exactly where oneDNN multiplies it natively. `low_precision_wins`: faster at every
    timed length, a tie or a missing third time counting against it."""
    from engine import prefill_choice
    from engine.linear import bf16_matmul_fast

    assert prefill_choice.prompt_low_dtype(_model(5)) is None
    native = torch.bfloat16 if bf16_matmul_fast() else None
    assert prefill_choice.prompt_low_dtype(_model(5, kv_dtype=torch.bfloat16)) == native
    monkeypatch.setattr(prefill_choice, "bf16_matmul_fast", lambda: False)   # as on an AVX2-only CPU
    assert prefill_choice.prompt_low_dtype(_model(5, kv_dtype=torch.bfloat16)) is None
    wins = prefill_choice.low_precision_wins
    assert wins({128: (3.0, 2.0, 1.0), 1024: (3.0, 2.0, 1.9)})
    assert not wins({128: (3.0, 2.0, 1.0), 1024: (3.0, 2.0, 2.0)}) and not wins({128: (3.0, 2.0)}) and not wins({})


def _slow_in(dtype, real):
    """Injected fault: torch's SDPA made slower by `SLOWER` in each call on ``dtype`` queries."""

    def sdpa(q, *args, **kwargs):
        if q.dtype == dtype:
            time.sleep(SLOWER)
        return real(q, *args, **kwargs)
    return sdpa


@pytest.mark.parametrize("slower", [torch.float32, torch.bfloat16])
def test_auto_takes_bfloat16_prompt_attention_only_where_it_was_timed_faster(monkeypatch, caplog, slower):
    """Over a bfloat16 pool on a CPU that multiplies bfloat16 natively (forced here, so the rule
    runs on any CPU), ``auto`` times SDPA in bfloat16 beside SDPA in float32 and the kernel (made
    slower than both), takes bfloat16 (``model.prefill_attn_dtype``) where it was faster at every
    length and keeps float32 where it was not; the prompt pass then attends in what was taken."""
    monkeypatch.setattr("engine.prefill_choice.bf16_matmul_fast", lambda: True)
    monkeypatch.setattr("engine.attention.F.scaled_dot_product_attention",
                        _slow_in(slower, torch.nn.functional.scaled_dot_product_attention))
    monkeypatch.setattr("worker.kernels.CompiledPrefill", _SlowPrefill)
    model = _model(5, kv_dtype=torch.bfloat16)
    pool = KVPool(TINY, CacheConfig(block_size=4, num_blocks=16, dtype="bfloat16"))
    model.prefill_attn_dtype = slower   # a previous choice, replaced by this one
    with caplog.at_level(logging.INFO, logger="worker.kernels"):
        set_attention_kernels(WorkerConfig(role="prefill", attention_backend="auto"), model, pool)
    (timed,) = [m for m in caplog.messages if m.startswith("prompt attention: ") and "measured on" in m]
    assert model.prefill_kernel is None and "us SDPA in bfloat16" in timed
    if slower == torch.float32:
        assert model.prefill_attn_dtype == torch.bfloat16 and timed.startswith("prompt attention: SDPA in bfloat16 at")
    else:
        assert model.prefill_attn_dtype is None and timed.startswith("prompt attention: SDPA at every length")
    seen = []
    monkeypatch.setattr("engine.attention.F.scaled_dot_product_attention",
                        lambda q, *a, **kw: seen.append(q.dtype) or torch.zeros_like(q))
    model.forward(ForwardBatch.build([SeqChunk([1, 2, 3, 4, 5], 0, [0, 1])], 4), pool)
    assert seen == [model.prefill_attn_dtype or torch.float32] * TINY.num_layers
