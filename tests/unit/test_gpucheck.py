"""`deploy.gpucheck`'s CPU-side parts: the report parser (JUnit XML, else the live ``-v`` log of a
pytest killed at its limit) and the tier's collection paths covering every cuda test."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.gpucheck import ROOT, TIER_PATHS, _tests

pytestmark = pytest.mark.unit


def test_outcomes_come_from_the_report_else_from_the_log(tmp_path):
    xml = tmp_path / "cuda.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.integration.test_x" name="test_a" time="1.5"/>'
                   '<testcase classname="tests.integration.test_x" name="test_b" time="0.1">'
                   '<failure message="assert 1 == 2"/></testcase></testsuite></testsuites>')
    rows = _tests(xml, tmp_path / "none.log")
    assert [(r["test"], r["outcome"], r["message"]) for r in rows] == [
        ("test_x::test_a", "passed", ""), ("test_x::test_b", "failed", "assert 1 == 2")]
    log = tmp_path / "cuda-tier.log"
    log.write_text("[gw1] [ 10%] PASSED tests/integration/test_x.py::test_a \n"
                   "tests/integration/test_x.py::test_b FAILED\nnoise\n")
    rows = _tests(tmp_path / "missing.xml", log)
    assert [(r["test"], r["outcome"]) for r in rows] == [("test_x.py::test_a", "passed"), ("test_x.py::test_b", "failed")]


def test_every_cuda_test_lies_under_the_tier_paths():
    outside = [p.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")
               if "mark.cuda" in p.read_text() and not any(str(p.relative_to(ROOT)).startswith(t) for t in TIER_PATHS)]
    assert not outside, f"cuda tests outside {TIER_PATHS}: {outside}"
    assert any("mark.cuda" in p.read_text() for p in (ROOT / "tests" / "integration").glob("test_*.py"))
