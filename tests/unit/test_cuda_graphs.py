"""`engine.cuda_graphs`: the decode step over the graphs' static buffers, checked on the CPU
without capture under Triton's interpreter (`tests/unit/cuda_graph_cases.py`, in a process of its
own): logits and K/V equal the eager step's, padding rows write only the graphs' own block, the
block is held (the pool has one block fewer), steps past the largest bucket run eagerly. Captured
graphs on a GPU: tests/integration/test_engine_cuda.py."""

from __future__ import annotations

import json

import pytest

from engine.cuda_graphs import buckets, unsupported
from tests.interpreted import run_interpreted
from tests.unit.test_engine_runner import _model

pytestmark = pytest.mark.unit


def test_static_buffers_and_padding_give_the_eager_step():
    r = json.loads(run_interpreted("tests.unit.cuda_graph_cases").splitlines()[-1])
    assert r["worst_logit_diff"] < 1e-4 and r["pool_diff"] < 1e-4
    assert r["steps"] == [[4, [3, 64]]] * 4   # three sequences replayed in the bucket of 4
    assert r["pad_block_written"] and r["free_blocks"][0] == r["free_blocks"][1]
    assert r["five_rows_run_eagerly"] and r["buckets"] == [1, 2, 4]


def test_buckets_and_what_is_refused(monkeypatch):
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32] and buckets(1) == [1] and buckets(12) == [1, 2, 4, 8, 12]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "cannot run on cpu" in unsupported(_model())
