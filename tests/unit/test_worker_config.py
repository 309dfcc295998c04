"""Worker configuration and protocol conversions: pure logic."""

import argparse

import pytest

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from rpc import pdserve_pb2 as pb
from worker.config import DEFAULT_NUM_BLOCKS, WorkerConfig
from worker.convert import sampling_from_proto, sampling_to_proto

pytestmark = pytest.mark.unit


def test_defaults_and_generated_worker_id():
    c = WorkerConfig(role="decode")
    assert c.worker_id.startswith("decode-") and c.listen_port == 0 and c.host_for_peers == "127.0.0.1"


def test_num_blocks_defaults_per_role():
    """A prefill worker's pool holds what it computes and sends (half a decode worker's); 0 or
    no flag picks the role's default, any other value is taken as given."""
    assert WorkerConfig(role="prefill").num_blocks == DEFAULT_NUM_BLOCKS["prefill"] == 1024
    assert WorkerConfig(role="decode", num_blocks=0).num_blocks == DEFAULT_NUM_BLOCKS["decode"] == 2048
    assert WorkerConfig(role="prefill", num_blocks=4096).num_blocks == 4096


@pytest.mark.parametrize("kwargs, match", [
    ({"role": "router"}, "role"),
    ({"role": "decode", "transfer_engine": "udp"}, "transfer_engine"),
    ({"role": "decode", "num_blocks": -1}, "num_blocks"),
    ({"role": "decode", "listen": "nohost"}, "host:port"),
    ({"role": "decode", "secret": b"short"}, "secret"),
    ({"role": "decode", "quarantine_s": 10.0}, "quarantine_s"),
    ({"role": "decode", "weights": "int4"}, "weights"),
    ({"role": "decode", "weights": "native", "device": "cuda", "transfer_engine": "verbs"}, "CPU only"),
    ({"role": "prefill", "kv_send": "chunk"}, "kv_send"),
    ({"role": "decode", "max_prefill_tokens_while_decoding": 0}, "max_prefill_tokens_while_decoding"),
    ({"role": "decode", "max_prefill_seconds_while_decoding": -1.0}, "max_prefill_seconds_while_decoding"),
    ({"role": "decode", "max_prefill_seconds_while_decoding": float("nan")}, "max_prefill_seconds_while_decoding"),
    ({"role": "decode", "linear_backend": "mkl"}, "linear_backend"),
    ({"role": "decode", "linear_backend": "template", "tensor_parallel_size": 2}, "tensor parallel size 1"),
])
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkerConfig(**kwargs)


@pytest.mark.parametrize("kv_send, device, per_layer", [
    ("auto", "cpu", False), ("auto", "cuda", True), ("auto", "cuda:1", True),
    ("layer", "cpu", True), ("pass", "cuda", False),
])
def test_kv_send_auto_posts_at_the_pass_end_on_the_cpu_and_per_layer_on_a_gpu(kv_send, device, per_layer):
    assert WorkerConfig(role="prefill", weights="bf16", device=device, kv_send=kv_send).kv_send_per_layer is per_layer


def test_cli_flags_mirror_fields(monkeypatch):
    monkeypatch.setenv("PDSERVE_SECRET", "0123456789abcdef-from-env")
    ap = argparse.ArgumentParser()
    WorkerConfig.add_arguments(ap)
    c = WorkerConfig.from_args("prefill", ap.parse_args(["--num-blocks", "64", "--transfer-engine", "tcp",
                                                         "--transfer-timeout-s", "5", "--weights", "native"]))
    assert (c.num_blocks, c.transfer_engine, c.transfer_timeout_s) == (64, "tcp", 5.0)
    assert (c.weights, c.dtype, c.kv_dtype) == ("native", "float32", "bfloat16")
    assert c.secret == b"0123456789abcdef-from-env"


def test_sampling_round_trip_and_validation():
    p = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_p=0.25, seed=3, stop_token_ids=(2,))
    back = sampling_from_proto(sampling_to_proto(p))
    assert back.min_p == 0.25 and sampling_from_proto(pb.SamplingParams(max_tokens=1)).min_p == 0.0
    assert back.max_tokens == 7 and back.top_k == 20 and back.seed == 3 and back.stop_token_ids == (2,)
    assert abs(back.temperature - 0.5) < 1e-6 and abs(back.top_p - 0.9) < 1e-6
    assert sampling_from_proto(pb.SamplingParams(max_tokens=1)).seed is None
    with pytest.raises(InvalidRequestError):
        sampling_from_proto(pb.SamplingParams(max_tokens=0))


def test_tensor_parallel_workers_run_eagerly_and_the_launcher_sizes_each_worker(tmp_path):
    from deploy.launcher import Cluster, LauncherConfig

    assert WorkerConfig(role="decode", tensor_parallel_size=3).tensor_parallel_size == 3
    assert WorkerConfig(role="prefill", tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="compiled layers do not run tensor-parallel"):
        WorkerConfig(role="decode", tensor_parallel_size=2, enforce_eager=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        WorkerConfig(role="decode", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="prefill_tp must list sizes >= 1"):
        LauncherConfig(prefill_tp=(0,))
    cluster = LauncherConfig(num_prefill=2, num_decode=3, decode_tp=(3, 1), prefill_tp=(2,), log_dir=str(tmp_path))
    argv = {w.name: w.argv for w in Cluster(cluster).workers}
    assert argv["decode-0"][argv["decode-0"].index("--tensor-parallel-size") + 1] == "3"
    assert "--tensor-parallel-size" not in argv["decode-1"] and "--tensor-parallel-size" not in argv["decode-2"]
    assert all(argv[p][argv[p].index("--tensor-parallel-size") + 1] == "2" for p in ("prefill-0", "prefill-1"))


def test_transfer_engines_agree_and_cuda_ipc_needs_a_gpu_pool():
    from deploy.launcher import TRANSFER_ENGINES as LAUNCHER_ENGINES
    from worker.config import TRANSFER_ENGINES

    assert LAUNCHER_ENGINES == TRANSFER_ENGINES   # the launcher's torch-free copy
    with pytest.raises(ValueError, match="cuda_ipc transfer engine moves GPU pools"):
        WorkerConfig(role="decode", transfer_engine="cuda_ipc")
    assert WorkerConfig(role="decode", transfer_engine="tcp", device="cuda").device == "cuda"   # staged


def test_linear_backends_agree_with_the_engines():
    from engine.linear import BACKENDS
    from worker.config import LINEAR_BACKENDS

    assert LINEAR_BACKENDS == BACKENDS   # the config's torch-free copy
    assert WorkerConfig(role="decode").linear_backend == "auto"
