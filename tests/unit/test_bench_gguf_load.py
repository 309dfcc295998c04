"""`bench.gguf_load`: each row runs in its own process and lands in the table's JSON."""

from __future__ import annotations

import json

import pytest

from bench.gguf_load import main

pytestmark = pytest.mark.unit


def test_both_reader_rows_run_and_are_written(tmp_path):
    out = tmp_path / "gguf_load.json"
    result = main(["--rows", "package-reader,reader", "--rounds", "1", "--json", str(out)])
    assert [r["row"] for r in result["rows"]] == ["package-reader", "reader"]
    assert all(len(r["seconds"]) == 1 and r["median_s"] > 0 for r in result["rows"])
    written = json.loads(out.read_text())
    assert "header" in written and [r["row"] for r in written["rows"]] == ["package-reader", "reader"]
