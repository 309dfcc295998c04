"""What a newcomer gets: ``pdserve up``'s defaults, and ``--weights auto``'s choice per checkpoint."""

from __future__ import annotations

import json

import pytest

from deploy.cli import build_parser, launcher_config
from engine.config import SchedulerConfig
from engine.errors import ModelLoadError
from engine.linear import bf16_matmul_fast
from engine.loader import resolve_weights
from engine.quant import int4_kernel_available
from worker.config import WorkerConfig


def _hf_dir(tmp_path, **fields):
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return tmp_path


def test_pdserve_up_defaults_to_auto_weights_and_prefix_caching_with_kv_routing():
    config = launcher_config(build_parser().parse_args(["up"]))
    assert config.weights == "auto"
    assert "--prefix-caching" in config.worker_args
    assert config.router_args == ("--policy", "kv")


def test_no_prefix_caching_turns_it_off_and_routes_by_load():
    config = launcher_config(build_parser().parse_args(["up", "--no-prefix-caching", "--weights", "fp32"]))
    assert config.weights == "fp32"
    assert "--prefix-caching" not in config.worker_args
    assert config.router_args == ("--policy", "load")


@pytest.mark.skipif(not int4_kernel_available(), reason="this torch build has no CPU int4 kernel")
def test_auto_runs_the_default_4bit_gguf_as_stored_on_the_cpu():
    mode, why = resolve_weights("auto")
    assert mode == "native" and "Q4_1" in why
    assert resolve_weights("auto", device="cuda")[0] == "bf16"   # no int4 kernel there


def test_auto_takes_a_hugging_face_checkpoints_dtype(tmp_path):
    bf16 = "bf16" if bf16_matmul_fast() else "fp32"
    assert resolve_weights("auto", _hf_dir(tmp_path / "a", dtype="bfloat16"))[0] == bf16
    assert resolve_weights("auto", _hf_dir(tmp_path / "b", torch_dtype="float16"))[0] == bf16
    assert resolve_weights("auto", _hf_dir(tmp_path / "c", torch_dtype="bfloat16"), device="cuda")[0] == "bf16"
    assert resolve_weights("auto", _hf_dir(tmp_path / "d", torch_dtype="float32"))[0] == "fp32"
    assert resolve_weights("auto", _hf_dir(tmp_path / "e"))[0] == "fp32"   # no dtype: the reference


def test_auto_refuses_a_dtype_it_does_not_serve_naming_the_field(tmp_path):
    with pytest.raises(ModelLoadError, match="torch_dtype='float8_e4m3fn'"):
        resolve_weights("auto", _hf_dir(tmp_path / "f", torch_dtype="float8_e4m3fn"))


def test_an_explicit_mode_is_kept_and_an_unknown_one_refused(tmp_path):
    assert resolve_weights("fp32", _hf_dir(tmp_path / "g", dtype="bfloat16")) == ("fp32", "asked for")
    with pytest.raises(ValueError, match="weights must be one of"):
        resolve_weights("int4")
    assert WorkerConfig(role="prefill", weights="auto").weights == "auto"   # resolved at load
    with pytest.raises(ValueError, match="weights must be one of"):
        WorkerConfig(role="prefill", weights="int4")


def test_pdserve_up_runs_eagerly_unless_told_otherwise():
    assert "--no-enforce-eager" not in launcher_config(build_parser().parse_args(["up"])).worker_args
    config = launcher_config(build_parser().parse_args(["up", "--no-enforce-eager"]))
    assert "--no-enforce-eager" in config.worker_args


def test_pdserve_up_keeps_onednn_unless_asked_for_the_gemm_template():
    assert "--linear-backend" not in launcher_config(build_parser().parse_args(["up"])).worker_args
    args = launcher_config(build_parser().parse_args(["up", "--linear-backend", "template"])).worker_args
    assert args[args.index("--linear-backend") + 1] == "template"


def test_pdserve_up_leaves_the_prefill_batch_to_the_timed_knee_unless_told_one():
    """No ``--prefill-batch-tokens``: the workers time the CPU's knee (`engine.prefill_knee`)."""
    assert "--prefill-batch-tokens" not in launcher_config(build_parser().parse_args(["up"])).worker_args
    assert WorkerConfig(role="prefill").prefill_batch_tokens == 0
    args = launcher_config(build_parser().parse_args(["up", "--prefill-batch-tokens", "256"])).worker_args
    assert args[args.index("--prefill-batch-tokens") + 1] == "256"


def test_pdserve_up_serves_in_auto_mode_unless_told_another():
    """One prefill and one decode worker in auto mode (docs/PERFORMANCE.md, "Auto mode by default")."""
    config = launcher_config(build_parser().parse_args(["up"]))
    assert config.serving_mode == "auto" and (config.num_prefill, config.num_decode) == (1, 1)
    assert launcher_config(build_parser().parse_args(["up", "--serving-mode", "disaggregated"])).serving_mode \
        == "disaggregated"


def test_pdserve_up_passes_the_decode_prompt_budget_to_its_workers():
    def budget(*argv):
        args = launcher_config(build_parser().parse_args(["up", *argv])).worker_args
        return args[args.index("--max-prefill-tokens-while-decoding") + 1]

    assert budget() == "2048" and WorkerConfig(role="decode").max_prefill_tokens_while_decoding == 2048
    assert budget("--max-prefill-tokens-while-decoding", "64") == "64"


def test_pdserve_up_bounds_a_decode_step_s_prompt_tokens_in_time():
    """A step beside decoding sequences carries at most ~1 s of prompt tokens at the worker's
    measured rate (docs/PERFORMANCE.md, "Prompt tokens beside decoding sequences, bounded in time");
    the engine's own scheduler keeps the token budget alone."""
    def seconds(*argv):
        args = launcher_config(build_parser().parse_args(["up", *argv])).worker_args
        return float(args[args.index("--max-prefill-seconds-while-decoding") + 1])

    assert seconds() == 1.0 == WorkerConfig(role="decode").max_prefill_seconds_while_decoding
    assert seconds("--max-prefill-seconds-while-decoding", "0") == 0.0
    assert SchedulerConfig().max_prefill_seconds_while_decoding == 0.0
    with pytest.raises(ValueError, match="max_prefill_seconds_while_decoding"):
        SchedulerConfig(max_prefill_seconds_while_decoding=-0.5)


def test_pdserve_up_asks_for_the_compiled_decode_attention_where_it_can_run():
    """`pdserve up` gives its workers ``--attention-backend auto`` (compiled where inductor builds
    it) unless told otherwise, and ``grouped`` with tensor parallelism; a worker's own default is
    grouped, and it refuses an unknown backend and a compiled one with tensor parallelism."""
    def backend(*argv):
        args = launcher_config(build_parser().parse_args(["up", *argv])).worker_args
        return args[args.index("--attention-backend") + 1]

    assert backend() == "auto"
    assert backend("--attention-backend", "grouped") == "grouped"
    assert backend("--decode-tp", "2") == "grouped"
    assert WorkerConfig(role="decode").attention_backend == "grouped"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        WorkerConfig(role="decode", attention_backend="flash")
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        WorkerConfig(role="decode", attention_backend="auto", tensor_parallel_size=2)


def test_pdserve_up_pins_each_one_thread_worker_to_a_cpu_of_its_own(monkeypatch):
    """With a CPU for every worker, `pdserve up` pins them one each (and so lends idle CPUs,
    `worker.cpu_board`); with more threads, TP ranks, too few CPUs or ``--cpu-affinity ''`` it
    pins none, and an explicit list wins."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 3, 5, 7})

    def affinity(*argv):
        return launcher_config(build_parser().parse_args(["up", *argv])).cpu_affinity

    assert affinity() == (2, 3)
    assert affinity("--prefill", "2", "--decode", "2") == (2, 3, 5, 7)
    for argv in (("--threads", "2"), ("--decode-tp", "2"), ("--prefill", "3", "--decode", "2"),
                 ("--cpu-affinity", "")):
        assert affinity(*argv) == (), argv
    assert affinity("--cpu-affinity", "5,7") == (5, 7)
