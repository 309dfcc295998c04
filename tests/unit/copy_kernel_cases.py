"""`kvtransfer.copy_kernel.copy_ranges` on the CPU under ``TRITON_INTERPRET=1``, in a process of
its own (Triton fixes interpretation when it is imported): prints one line per case, ``name ok``
or ``name MISMATCH``. Run by `tests.unit.test_copy_kernel`."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from kvtransfer.copy_kernel import copy_ranges, unit_bytes


def case(name: str, ranges: list[tuple[int, int, int]] | np.ndarray, size: int = 1 << 16, src_shift: int = 0) -> None:
    gen = torch.Generator().manual_seed(len(ranges))
    src = torch.randint(0, 256, (size + src_shift,), dtype=torch.uint8, generator=gen)[src_shift:]
    dst = torch.zeros(size, dtype=torch.uint8)
    want = dst.clone()
    for d, s, n in ranges:
        want[d:d + n] = src[s:s + n]
    copy_ranges(dst, src, ranges)
    unit = unit_bytes([dst.data_ptr(), src.data_ptr(), *(v for r in ranges for v in r)])
    print(f"{name} unit={unit} {'ok' if torch.equal(dst, want) else 'MISMATCH'}", flush=True)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    case("kv-aligned", [(i * 2048, (31 - i) * 2048, 2048) for i in range(32)])
    case("one-long", [(0, 8, 40000), (40960, 0, 8)])   # more chunks than programs: each strides
    rng = random.Random(7)
    starts = sorted(rng.sample(range(0, 60000, 97), 20))
    case("ragged-odd", [(d, rng.randrange(0, 60000), rng.randrange(1, 90)) for d in starts])
    case("src-misaligned", [(0, 0, 64), (128, 64, 64)], src_shift=3)
    # what cuda_ipc passes: `copy_plan`'s (copies, 3) int64 array of a scattered plan
    case("plan-array", np.array([(i * 4096, (15 - i) * 4096 + 8, 4088) for i in range(16)], dtype=np.int64))


if __name__ == "__main__":
    main()
