"""`kvtransfer.copy_kernel.copy_ranges`, the one-launch range copy cuda_ipc writes with, against
plain slicing on the CPU under Triton's interpreter (`tests/unit/copy_kernel_cases.py`, in a process
of its own): aligned KV-shaped ranges moved in 8-byte units, a range longer than its programs'
first pass, ragged odd ranges and a misaligned source moved byte by byte, and the ``(n, 3)`` int64
array `kvtransfer.cuda_ipc.copy_plan` gives. Bad ranges are refused
before any launch."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.copy_kernel import copy_ranges, unit_bytes
from tests.interpreted import run_interpreted

pytestmark = pytest.mark.unit


def test_every_case_copies_exactly_the_ranges():
    lines = dict(line.split(" ", 1) for line in run_interpreted("tests.unit.copy_kernel_cases").splitlines())
    assert set(lines) == {"kv-aligned", "one-long", "ragged-odd", "src-misaligned", "plan-array"}
    assert lines["plan-array"] == "unit=8 ok"
    assert lines["kv-aligned"] == "unit=8 ok" and lines["one-long"] == "unit=8 ok"
    assert lines["ragged-odd"] == "unit=1 ok" and lines["src-misaligned"] == "unit=1 ok"


def test_units_and_refusals():
    assert unit_bytes([4096, 8, 16]) == 8 and unit_bytes([4096, 12]) == 4 and unit_bytes([6]) == 2
    assert unit_bytes([4096, 17]) == 1
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    for bad in ([(60, 0, 8)], [(0, 60, 8)], [(0, 0, 0)], [(-1, 0, 4)]):
        with pytest.raises(ValueError, match="outside"):
            copy_ranges(a, b, bad)
    with pytest.raises(ValueError, match="uint8"):
        copy_ranges(a.view(torch.int64), b.view(torch.int64), [(0, 0, 1)])
    copy_ranges(a, b, [])   # nothing to copy: no launch, no error
