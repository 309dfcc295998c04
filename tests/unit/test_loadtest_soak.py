"""`loadtest.soak`: the memory verdict, process naming and the workload."""

from __future__ import annotations

import itertools
import math
import os

import pytest

from loadtest.soak import Sample, children, passed, process_name, proc_status, verdict, workload

pytestmark = pytest.mark.unit

MB = 1_000_000


def _samples(curve: dict[str, list[float]], step: float = 60.0) -> list[Sample]:
    n = len(next(iter(curve.values())))
    return [Sample(i * step, i, {k: int(v[i] * MB) for k, v in curve.items() if v[i] is not None}, {})
            for i in range(n)]


def test_flat_after_warmup_passes_whatever_before():
    # grows 50% during the warm-up, then stays within 4%: the growth before --warm-s is free
    samples = _samples({"prefill-0": [100, 130, 150, 152, 148, 154], "router": [50] * 6})
    v = verdict(samples, warm_s=120, tolerance=0.05)
    assert v["prefill-0"].warm_t == 120 and v["prefill-0"].warm_rss == 150 * MB
    assert v["prefill-0"].drift == pytest.approx(4 / 150)
    assert v["prefill-0"].worst_t == 300
    assert passed(v) is True


def test_growth_past_tolerance_fails_and_names_the_process():
    samples = _samples({"prefill-0": [100, 100, 104, 106], "decode-0": [80, 80, 80, 80]})
    v = verdict(samples, warm_s=60, tolerance=0.05)
    assert not v["prefill-0"].passed and v["prefill-0"].drift == pytest.approx(0.06)
    assert v["prefill-0"].worst_t == 180
    assert v["decode-0"].passed and v["decode-0"].drift == 0.0
    assert passed(v) is False


def test_a_drop_counts_as_drift_too():
    v = verdict(_samples({"p": [100, 100, 90]}), warm_s=60, tolerance=0.05)
    assert v["p"].drift == pytest.approx(0.1) and not v["p"].passed


def test_warm_reference_is_first_sample_at_or_after_warm_s():
    samples = _samples({"p": [10, 20, 30, 31]}, step=50.0)   # t = 0, 50, 100, 150
    v = verdict(samples, warm_s=90, tolerance=0.05)
    assert v["p"].warm_t == 100 and v["p"].warm_rss == 30 * MB


def test_process_gone_after_warmup_fails():
    samples = _samples({"p": [10, 10, 10, None], "q": [5, 5, 5, 5]})
    v = verdict(samples, warm_s=60, tolerance=0.05)
    assert math.isinf(v["p"].drift) and not v["p"].passed and v["q"].passed


def test_no_sample_after_warmup_gives_no_verdict():
    v = verdict(_samples({"p": [10, 50]}), warm_s=600, tolerance=0.05)
    assert v == {} and passed(v) is None


def test_process_names_from_command_lines():
    assert process_name(["python", "-m", "router", "--http-port", "1"]) == "router"
    assert process_name(["python", "-m", "prefill", "--worker-id", "prefill-0"]) == "prefill-0"
    assert process_name(["/usr/bin/thing"]) == "thing"


def test_proc_status_and_children_of_this_process():
    status = proc_status(os.getpid())
    assert status["VmRSS"] > 0 and status["VmHWM"] >= status["VmRSS"]
    assert proc_status(2 ** 22 + 12345) == {}
    assert os.getpid() in children(os.getppid())


def test_workload_is_endless_seeded_with_fixed_output():
    first = list(itertools.islice(workload(256, 64, 0.5, seed=7), 300))
    assert first == list(itertools.islice(workload(256, 64, 0.5, seed=7), 300))
    assert all(r.expected_output_len == 64 and 128 <= r.prompt_len <= 384 for r in first)
    assert first[0] != first[256]   # the next block has its own seed
