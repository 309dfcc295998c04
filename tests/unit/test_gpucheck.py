"""`deploy.gpucheck` and `bench.gpu` on the CPU: the report parser (JUnit XML, else the live ``-v``
log of a pytest killed at its limit), the tier's collection paths covering every cuda test, the
cuda_ipc fit, and the bench's CPU smoke run (so the script a GPU session runs has not rotted)."""

from __future__ import annotations

import time

import pytest

from deploy.gpucheck import ROOT, TIER_PATHS, _tests

@pytest.mark.unit
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


@pytest.mark.unit
def test_every_cuda_test_lies_under_the_tier_paths():
    outside = [p.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")
               if "mark.cuda" in p.read_text() and not any(str(p.relative_to(ROOT)).startswith(t) for t in TIER_PATHS)]
    assert not outside, f"cuda tests outside {TIER_PATHS}: {outside}"
    assert any("mark.cuda" in p.read_text() for p in (ROOT / "tests" / "integration").glob("test_*.py"))


@pytest.mark.unit
def test_cuda_ipc_time_splits_into_fixed_and_streaming():
    from bench.gpu import fixed_and_streaming

    def run(nbytes: float, fixed_s: float = 1e-3, rate: float = 2e12) -> dict:
        return {"bytes": nbytes, "ipc_gb_s": nbytes / (fixed_s + nbytes / rate) / 1e9}

    fit = fixed_and_streaming([run(5.4e8), run(2.1e9)])
    assert abs(fit["fixed_us"] - 1000) < 1e-6 and abs(fit["streaming_gb_s"] - 2000) < 1e-6


@pytest.mark.unit
def test_paired_timing_alternates_its_sides_and_keeps_each_ones_best():
    """`bench.gpu.paired_best`: warm-up rounds untimed, then ``a b a b ...``, each side's best call."""
    from bench.gpu import paired_best

    calls, naps = [], iter([0.0, 0.0, 0.02, 0.0, 0.0, 0.03])   # warm-up a b, then a b, a b

    def side(name):
        return lambda: (calls.append(name), time.sleep(next(naps)))

    best = paired_best([side("a"), side("b")], "cpu", reps=2, warmup=1)
    assert calls == ["a", "b"] * 3
    assert best[0] < 0.015 and best[1] < 0.015   # a's slow call and b's slow call are not the best ones


@pytest.mark.integration
def test_the_gpu_bench_runs_its_cpu_smoke(tmp_path):
    """`bench.gpu` on the CPU at its smoke sizes (eager, no cuda_ipc): the script a GPU session
    runs still runs, and writes its rows."""
    from bench.gpu import main
    from tests.integration.test_model_families import save_tokenizer

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    out = main(["--device", "cpu", "--quick", "--no-compiled", "--batches", "1,2", "--weights", "fp32",
                "--tokenizer", str(tokenizer), "--json", str(tmp_path / "gpu.json")])
    assert [(r["phase"], r["batch"]) for r in out["rows"]] == [("prefill", 1), ("decode", 1), ("prefill", 2),
                                                             ("decode", 2)]
    assert all(r["pdserve_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in out["rows"])
    assert (tmp_path / "gpu.json").exists() and "cuda_ipc" not in out
    kernels = out["prefill_kernels"]   # bench.prefill_profile, after the last dtype's eager rows
    assert all(kernels[side]["kernels"] and kernels[side]["total_us"] > 0 for side in ("ours", "theirs"))


@pytest.mark.integration
def test_the_transfer_rounds_the_gpu_bench_times_run_over_shm(tmp_path):
    """`bench.gpu --shm-rounds`: the round `ipc_rate` times for cuda_ipc (receiver process, slots,
    posts, ACKs, counting), over shm with host pools: every round is counted, one and
    `IPC_IN_FLIGHT` transfers at a time, and its phases come in order."""
    import json

    from bench.gpu import IPC_IN_FLIGHT, main

    out = main(["--shm-rounds", "--json", str(tmp_path / "rounds.json")])["shm_rounds"]
    assert [r["in_flight"] for r in out] == [1, IPC_IN_FLIGHT]
    for r in out:
        assert r["writes"] == 512 and r["bytes"] == 512 * 4096
        assert 0 < r["posted_us"] <= r["acked_us"] <= r["counted_us"] and r["round_trip_us"] > 0
    assert len(json.loads((tmp_path / "rounds.json").read_text())["shm_rounds"]) == 2


@pytest.mark.integration
def test_a_traced_round_stamps_every_step_of_both_processes_in_causal_order():
    """`bench.round_trace` over shm (the path cuda_ipc shares) and tcp: every wrapped step of the
    writer and of the receiver process is stamped, and steps that cause one another come in
    that order (per round, hence in their medians too); this process's engines are untraced after."""
    from bench.round_trace import trace_rounds
    from kvtransfer import connection, software

    untraced = (software.SoftwareEngine.post_writes, connection.OutboundStream.__init__)
    for kind in ("shm", "tcp"):
        trace = trace_rounds(kind, 80, 4096, 3, streams=1)
        at = {s["step"]: s["us"] for s in trace["steps"]}
        assert set(at) == {"post", "posted", "tx woke", "send", "sent", "frame", "checked", "placed", "delivered",
                           "acking", "counted", "ack", "waited"}, kind
        assert at["post"] == 0 and trace["round_trip_us"] > 0
        for a, b in (("post", "posted"), ("tx woke", "send"), ("send", "frame"), ("frame", "checked"),
                     ("checked", "placed"), ("placed", "delivered"), ("delivered", "counted"), ("acking", "ack"),
                     ("ack", "waited")):
            assert at[a] <= at[b], (kind, a, b, at)
        assert (software.SoftwareEngine.post_writes, connection.OutboundStream.__init__) == untraced   # put back
