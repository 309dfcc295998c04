"""`worker.runtime`'s choice of a CPU decode worker's decode attention (``--attention-backend``):
the compiled kernel built at start-up, and what happens where inductor cannot build it (a fault
injected by replacing the kernel's class with one that fails as a missing C++ compiler would)."""

from __future__ import annotations

import logging

import pytest

from engine.paged_decode import CompiledDecode
from engine.config import CacheConfig
from engine.kv_cache import KVPool
from tests.unit.test_engine_runner import TINY, _model
from worker.config import WorkerConfig
from worker.runtime import _set_decode_kernel

pytestmark = pytest.mark.unit


class _NoCompiler(CompiledDecode):
    """Injected fault: the first call fails as inductor does without a C++ compiler."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found (injected)")


@pytest.fixture()
def model_and_pool():
    return _model(5), KVPool(TINY, CacheConfig(block_size=4, num_blocks=16))


def test_auto_and_compiled_build_the_kernel_and_grouped_or_a_prefill_worker_do_not(model_and_pool, caplog):
    model, pool = model_and_pool
    for role, backend in (("decode", "grouped"), ("prefill", "auto"), ("prefill", "compiled")):
        _set_decode_kernel(WorkerConfig(role=role, attention_backend=backend), model, pool)
        assert model.decode_kernel is None
    with caplog.at_level(logging.INFO, logger="worker.runtime"):
        _set_decode_kernel(WorkerConfig(role="decode", attention_backend="auto"), model, pool)
    assert isinstance(model.decode_kernel, CompiledDecode)
    assert "decode attention: compiled" in caplog.text
    assert pool.allocator.num_free == pool.allocator.num_blocks   # the warm-up gave its blocks back


def test_where_the_kernel_cannot_be_built_auto_keeps_the_grouped_path_and_compiled_refuses(
        model_and_pool, monkeypatch, caplog):
    model, pool = model_and_pool
    monkeypatch.setattr("worker.runtime.CompiledDecode", _NoCompiler)
    with caplog.at_level(logging.WARNING, logger="worker.runtime"):
        _set_decode_kernel(WorkerConfig(role="decode", attention_backend="auto"), model, pool)
    assert model.decode_kernel is None
    assert "decode attention: grouped" in caplog.text and "No working C++ compiler" in caplog.text
    with pytest.raises(ValueError, match="--attention-backend compiled: the kernel could not be built"):
        _set_decode_kernel(WorkerConfig(role="decode", attention_backend="compiled"), model, pool)
    assert model.decode_kernel is None
    assert pool.allocator.num_free == pool.allocator.num_blocks


def test_the_kernel_takes_torchs_isa_detection_unless_told_otherwise():
    """No probe libraries built and loaded in child processes at each start (`CompiledDecode`);
    an explicit ``TORCHINDUCTOR_VEC_ISA_OK`` (inductor's ``cpp.vec_isa_ok``) is kept. Inductor's
    own ``patch`` sets and restores the option: pytest's monkeypatch would delete it on undo
    (it cannot read the old value off inductor's config proxy), hiding it from later tests."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        CompiledDecode()
        assert inductor_config.cpp.vec_isa_ok is True
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        CompiledDecode()
        assert inductor_config.cpp.vec_isa_ok is False
