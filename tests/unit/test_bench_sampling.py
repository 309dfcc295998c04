"""`bench.sampling`: the sampler timed three ways per row count, written to JSON."""

from __future__ import annotations

import json

import pytest

from bench.sampling import main

pytestmark = pytest.mark.unit


def test_each_row_count_is_timed_three_ways_and_written(tmp_path):
    out = tmp_path / "sampling.json"
    result = main(["--reps", "1", "--rows", "1,3", "--vocab", "1000", "--json", str(out)])
    assert [r["rows"] for r in result["rows"]] == [1, 3]
    assert all(r[k] > 0 for r in result["rows"] for k in ("sample_ms", "one_at_a_time_ms", "greedy_ms"))
    assert json.loads(out.read_text())["rows"] == result["rows"]
