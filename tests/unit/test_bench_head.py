"""`bench.head`: the native head's two paths timed on the model's own hidden states, written
to JSON, the greedy token the same through both."""

from __future__ import annotations

import json

import pytest

from bench.head import PROMPTS, main

pytestmark = pytest.mark.unit


def test_both_paths_are_timed_on_real_rows_and_agree_on_the_greedy_token(tmp_path):
    out = tmp_path / "head.json"
    result = main(["--reps", "1", "--rows", "1,9", "--json", str(out)])
    assert [r["rows"] for r in result["rows"]] == [1, len(PROMPTS) + 1]   # past the prompts: repeated
    assert all(r["low_bit_ms"] > 0 and r["dense_ms"] > 0 and r["same_argmax"] for r in result["rows"])
    assert result["max_int8_rows"] in (4, 8)
    assert json.loads(out.read_text())["rows"] == result["rows"]
