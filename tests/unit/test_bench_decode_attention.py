"""`bench.decode_attention`: both kernels it times give the same attention on its ragged cases, and
it writes its table with the header that says where it ran."""

from __future__ import annotations

import json

import pytest
import torch

from bench.decode_attention import main

pytestmark = pytest.mark.unit


def test_bench_rows_agree_and_are_written(tmp_path):
    out = tmp_path / "decode_attention.json"
    result = main(["--batches", "1,3", "--contexts", "40", "--reps", "1", "--json", str(out)])
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 40), (3, 40)]
    for r in result["rows"]:
        assert r["max_abs_diff"] < 1e-5
        assert r["grouped_s"] > 0 and r["indexed_compiled_s"] > 0 and r["one_call_s"] > 0
    written = json.loads(out.read_text())
    assert written["header"]["cpu"] and written["rows"] == result["rows"]


def test_spread_draws_each_context_from_its_range():
    from bench.decode_attention import BLOCK, cases

    *_, fb, tables, lens = cases(64, 200, torch.Generator().manual_seed(1), spread=0.5)
    assert 100 <= int(lens.min()) < 150 and 250 < int(lens.max()) <= 300
    assert fb.decode_lens == lens.tolist() and tables.shape == (64, -(-int(lens.max()) // BLOCK))
