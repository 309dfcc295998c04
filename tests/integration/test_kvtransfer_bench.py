"""``python -m bench.kvtransfer`` runs end to end (own engines and ceilings; peers are optional
and measured only by hand) and writes a JSON with every (shape, method) and its ratios."""

from __future__ import annotations

import json

import pytest

from bench import kvtransfer as bench

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_quick_writes_every_shape_and_method(tmp_path, capsys):
    out = tmp_path / "kv.json"
    methods = ["memcpy", "socket", "socket-sg", "tcp", "shm"]
    assert bench.main(["--quick", "--methods", ",".join(methods), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    got = {(r["shape"], r["method"]): r for r in doc["results"]}
    shapes = [s.name for s in bench.shapes(True, 448 << 20)]
    assert set(got) == {(s, m) for s in shapes for m in methods}
    for (shape, method), r in got.items():
        assert r["gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 and r["iters"] >= 2
        others = {m for m in methods if m != method and m in ("memcpy", "socket", "socket-sg")}
        assert set(r["ratios"]) == others
    table = capsys.readouterr().out
    assert "kv-128tok" in table and "socket-sg" in table
