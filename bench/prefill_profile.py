"""Where a prefill pass's device time goes, the engine's and transformers' side by side.

`bench.gpu` calls `prefill_kernels` after its eager rows of the largest batch (bf16 batch 128 is
the one prefill row below transformers on the H100s: docs/PERFORMANCE.md), so that a GPU session
names the kernels that differ. Not a figure of its own: the profiler slows both sides alike.
"""

from __future__ import annotations

import torch

TOP = 12
"""Kernels (or ops, on the CPU) listed per side."""


def _kernels(prof, passes: int, device: str) -> tuple[list[dict], float]:
    """The ``TOP`` entries of ``prof`` by self device time (CPU time on the CPU) per pass, and
    the sum over every entry, in microseconds per pass."""
    cuda = device.startswith("cuda")
    rows = []
    for e in prof.key_averages():
        us = (e.self_device_time_total if cuda else e.self_cpu_time_total) / passes
        if us > 0:
            rows.append({"name": e.key[:90], "us": us, "calls": e.count / passes})
    rows.sort(key=lambda r: -r["us"])
    return rows[:TOP], sum(r["us"] for r in rows)


@torch.inference_mode()
def prefill_kernels(sides: dict, device: str, passes: int = 3) -> dict:
    """Profile ``passes`` calls of each of ``sides`` (``{"ours", "theirs"}``: one prefill pass
    each, `bench.gpu.prefill_sides`) on ``device``, after one untimed call each. Returns, per
    side, ``kernels`` (the `TOP` kernels by self device time per pass: ``name``, ``us``,
    ``calls``) and ``total_us`` (every kernel's time per pass)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for name, fn in sides.items():
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(passes):
                fn()
            if cuda:
                torch.cuda.synchronize()
        top, total = _kernels(prof, passes, device)
        out[name] = {"kernels": top, "total_us": total}
    return out


def print_kernels(result: dict, label: str) -> None:
    """Both sides' tables, one after the other."""
    for side in ("ours", "theirs"):
        r = result[side]
        print(f"{label}, {'pdserve' if side == 'ours' else 'transformers'}: {r['total_us']:.0f} us of kernels per pass")
        print("| kernel | us per pass | calls per pass |\n|---|---|---|")
        for k in r["kernels"]:
            print(f"| {k['name']} | {k['us']:.0f} | {k['calls']:.0f} |")
