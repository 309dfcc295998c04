"""`bench.prefill_attention`: the three kernels it times give the same attention, the template's
build and the worker's differ in their score micro-GEMM only, neither lands in the disk cache a
worker loads, and it writes its table with the header that says where it ran."""

from __future__ import annotations

import json

import pytest

from bench.prefill_attention import main
from engine import aot_kernel

pytestmark = pytest.mark.unit


def test_bench_rows_agree_and_are_written_and_the_cache_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "prefill_attention.json"
    result = main(["--lengths", "130,200", "--cached", "16", "--reps", "1", "--json", str(out)])
    assert [(r["length"], r["cached"]) for r in result["rows"]] == [(130, 16), (200, 16)]
    for r in result["rows"]:
        assert r["max_abs_diff"] < 1e-5 and r["template_max_abs_diff"] < 1e-5
        assert r["sdpa_s"] > 0 and r["sdpa_masked_s"] > 0 and r["flex_template_s"] > 0 and r["flex_s"] > 0
    written = json.loads(out.read_text())
    assert written["header"]["cpu"] and written["rows"] == result["rows"]
    assert not aot_kernel.cache_dir().exists() or not any(aot_kernel.cache_dir().iterdir())
