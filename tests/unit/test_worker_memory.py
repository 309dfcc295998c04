"""`worker.runtime.bound_native_memory`: the prefill worker's kernel caches are bounded, the
decode worker's left alone, and values already in the environment win."""

from __future__ import annotations

import os

import pytest

from worker.runtime import PREFILL_KERNEL_CACHE, bound_native_memory

pytestmark = pytest.mark.unit

NAMES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_prefill_bounds_both_caches(clean_env):
    bound_native_memory("prefill")
    assert [os.environ[n] for n in NAMES] == [str(PREFILL_KERNEL_CACHE)] * 2


def test_decode_is_left_alone(clean_env):
    bound_native_memory("decode")
    assert not any(n in os.environ for n in NAMES)


def test_the_environment_wins(clean_env):
    clean_env.setenv("LRU_CACHE_CAPACITY", "512")
    bound_native_memory("prefill")
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(PREFILL_KERNEL_CACHE)
