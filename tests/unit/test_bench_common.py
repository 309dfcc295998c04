"""`bench.common`: timing after warm-up, the CPU flags read from /proc/cpuinfo, the JSON header."""

from __future__ import annotations

import argparse
import json
from datetime import datetime

import pytest
import torch

from bench import common

pytestmark = pytest.mark.unit

CPUINFO = """processor\t: 0
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni

processor\t: 1
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni
"""


def test_timed_warms_up_then_times_each_call():
    calls = []
    times = common.timed(lambda: calls.append(1), 5, warmup=2)
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)
    assert common.median_time(lambda: calls.append(1), 3) >= 0 and len(calls) == 7 + 4


def test_cpu_reads_the_model_and_each_flag():
    assert common.cpu(CPUINFO) == {"model": "Example CPU 9000",
                                   "flags": {"avx2": True, "avx512f": True, "avx512_bf16": False,
                                             "avx512_vnni": True}}
    assert set(common.cpu()) == {"model", "flags"}   # this machine's, whatever it is


def test_git_commit_is_unknown_outside_a_checkout(tmp_path):
    assert common.git_commit(tmp_path) == "unknown"


def test_write_json_puts_the_header_before_the_result(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "git_commit", lambda: "abc1234")
    args = argparse.Namespace(json=tmp_path / "out" / "r.json", quick=True)
    path = common.write_json(args.json, {"rows": [1, 2]}, args)
    doc = json.loads(path.read_text())
    assert list(doc) == ["header", "rows"] and doc["rows"] == [1, 2]
    head = doc["header"]
    assert datetime.fromisoformat(head["date"]).utcoffset().total_seconds() == 0
    assert head["torch"] == torch.__version__ and head["torch_threads"] == torch.get_num_threads()
    assert head["commit"] == "abc1234" and head["command"] and set(head["cpu"]) == {"model", "flags"}
    assert head["options"] == {"json": str(args.json), "quick": True}   # a path written as its str


def test_arg_parser_names_the_module():
    assert common.arg_parser("bench.example", "what it does").format_usage().startswith(
        "usage: python -m bench.example")
