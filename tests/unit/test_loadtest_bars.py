"""The engine issue's acceptance bars read from `loadtest.peers` records: every bar met, each one
missed, strict and inclusive comparisons, no stand-in for the pair, what was not measured and why,
and runs of another workload refused with the field named."""

import json

import pytest

from loadtest.bars import BARS, HEAVY_MIX, MAIN_MIX, evaluate, load_run, main

pytestmark = pytest.mark.unit


def _result(tok_s, tpot_p50, ttft_p50, ttft_p99, tpot_p99=None, failed=0):
    return {"result": {"output_throughput": tok_s, "median_tpot_ms": tpot_p50, "median_ttft_ms": ttft_p50,
                       "p99_ttft_ms": ttft_p99, "p99_tpot_ms": tpot_p99 if tpot_p99 is not None else tpot_p50,
                       "completed": 96 - failed, "failed": failed}}


def _record(mix, runs, avx512=True):
    return {"settings": dict(mix), "machine": {"flags": {"avx2": True, "avx512f": avx512}}, "runs": runs}


def _main_runs(**override):
    runs = {"pdserve": {"1": _result(60, 12, 150, 180), "32": _result(340, 70, 1200, 2900)},
            "1p1d": {"32": _result(280, 40, 4000, 6000)},
            "colo2": {"32": _result(300, 90, 700, 3500)},
            "colo1": {"32": _result(180, 150, 900, 6000)},
            "vllm": {"1": _result(56, 16, 120, 140), "32": _result(333, 74, 1330, 3160)}}
    runs.update(override)
    return runs


def _heavy_runs(pair_tpot_p99=30.0, vllm_tpot_p99=150.0):
    return {"1p1d": {"16": _result(60, 20, 14000, 18000, tpot_p99=pair_tpot_p99)},
            "vllm": {"16": _result(100, 120, 2000, 6500, tpot_p99=vllm_tpot_p99)}}


def _by_bar(verdicts):
    return {v.bar: v for v in verdicts}


def test_every_bar_met_gives_exit_0_and_each_ratio(tmp_path, capsys):
    main_path, heavy_path = tmp_path / "main.json", tmp_path / "heavy.json"
    main_path.write_text(json.dumps(_record(MAIN_MIX, _main_runs())))
    heavy_path.write_text(json.dumps(_record(HEAVY_MIX, _heavy_runs())))
    out_path = tmp_path / "bars.json"
    assert main([str(main_path), str(heavy_path), "--json", str(out_path)]) == 0
    written = json.loads(out_path.read_text())["verdicts"]
    assert [v["bar"] for v in written] == [b.name for b in BARS]
    assert all(v["met"] for v in written)
    ratios = {v["bar"]: v["ratio"] for v in written}
    assert ratios["`pdserve up`, 32 in flight: output tok/s"] == pytest.approx(340 / 333)
    assert ratios["`pdserve up`, one request: TTFT p50"] == pytest.approx(150 / 120)
    assert ratios["colocated 2 threads vs 1, 32 in flight: output tok/s"] == pytest.approx(300 / 180)
    assert "| yes |" in capsys.readouterr().out


@pytest.mark.parametrize("override, missed", [
    ({"pdserve": {"1": _result(60, 12, 150, 180), "32": _result(250, 42, 4800, 6990)}},
     {"`pdserve up`, 32 in flight: output tok/s", "`pdserve up`, 32 in flight: TTFT p99"}),
    ({"pdserve": {"1": _result(60, 17, 190, 200), "32": _result(340, 70, 1200, 2900)}},
     {"`pdserve up`, one request: TPOT p50", "`pdserve up`, one request: TTFT p50"}),
    ({"1p1d": {"32": _result(266, 40, 4000, 6000)}}, {"1P1D, 32 in flight: output tok/s"}),
    ({"colo1": {"32": _result(190, 150, 900, 6000)}}, {"colocated 2 threads vs 1, 32 in flight: output tok/s"}),
])
def test_each_missed_bar_is_reported_and_only_it(override, missed):
    verdicts = evaluate(_record(MAIN_MIX, _main_runs(**override)), _record(HEAVY_MIX, _heavy_runs()))
    assert {v.bar for v in verdicts if not v.met} == missed
    assert all(v.reason == "" for v in verdicts)


def test_the_heavy_mix_bar_is_strict_and_ttft_p50_takes_one_and_a_half():
    tied = _by_bar(evaluate(_record(MAIN_MIX, _main_runs()), _record(HEAVY_MIX, _heavy_runs(150.0, 150.0))))
    assert not tied["1P1D, prefill-heavy mix: TPOT p99"].met
    runs = _main_runs(pdserve={"1": _result(60, 12, 180, 200), "32": _result(340, 70, 1200, 2900)})
    at_limit = _by_bar(evaluate(_record(MAIN_MIX, runs)))
    assert at_limit["`pdserve up`, one request: TTFT p50"].met   # 180 = 1.5 x 120


def test_the_pair_is_not_measured_without_a_server_named_1p1d():
    """`pdserve up` runs auto mode by default: it does not stand for one prefill and one decode worker."""
    runs = _main_runs()
    del runs["1p1d"]
    verdict = _by_bar(evaluate(_record(MAIN_MIX, runs)))["1P1D, 32 in flight: output tok/s"]
    assert verdict.server == "1p1d" and verdict.value is None and not verdict.met and "1p1d" in verdict.reason


def test_what_is_not_measured_says_why_and_fails():
    runs = _main_runs(colo2={"32": _result(300, 90, 700, 3500, failed=3)})
    del runs["vllm"]
    verdicts = _by_bar(evaluate(_record(MAIN_MIX, runs, avx512=False)))
    assert verdicts["`pdserve up`, 32 in flight: output tok/s"].reason == \
        "vLLM's CPU wheel needs AVX-512; this run's CPU has none"
    assert verdicts["1P1D, prefill-heavy mix: TPOT p99"].reason == "no prefill-heavy run given"
    assert "failed 3 requests" in verdicts["colocated 2 threads vs 1, 32 in flight: output tok/s"].reason
    assert not any(v.met for v in verdicts.values())


def test_another_reference_is_said_not_to_be_the_issues(tmp_path, capsys):
    path = tmp_path / "main.json"
    runs = _main_runs()
    runs["llama-server"] = runs.pop("vllm")
    path.write_text(json.dumps(_record(MAIN_MIX, runs, avx512=False)))
    assert main([str(path), "--reference", "llama-server"]) == 1   # the heavy bar is not measured
    out = capsys.readouterr().out
    assert "not the engine issue's bars" in out and "| llama-server |" in out


def test_a_run_of_another_workload_is_refused_with_the_field(tmp_path, capsys):
    path = tmp_path / "main.json"
    path.write_text(json.dumps(_record({**MAIN_MIX, "input_len": 512}, _main_runs())))
    with pytest.raises(ValueError, match="settings.input_len is 512"):
        load_run(path, MAIN_MIX)
    assert main([str(path)]) == 2
    assert "input_len" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main([str(tmp_path / "bad.json")]) == 2
