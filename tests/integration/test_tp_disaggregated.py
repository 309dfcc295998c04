"""KV between tensor-parallel groups of different sizes (`worker.tp_rank`, `kvtransfer.tp`), in
process over the tcp data plane: prefill workers at TP 1, 2 and 4 and decode workers at TP 1, 2
and 4 of a tiny Qwen2 checkpoint (8 query heads, 4 KV heads, weights scaled as in
`tests.integration.test_model_families`), each rank its own endpoint. For (prefill TP, decode TP)
= (1,1), (2,1), (1,2), (2,4) and (4,2), every prefill rank writes its heads straight into the decode
ranks that hold them; the decode side counts every rank's immediates against the plan's total;
greedy tokens equal the TP-1 engine's, and every block returns to both pools.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from decode.arrivals import DecodeArrivals
from decode.server import NUM_TRANSFER_SLOTS
from decode.worker import DecodeWorker
from engine.config import CacheConfig
from engine.loader import build_generator, load_model
from engine.sampling import SamplingParams
from prefill.worker import PrefillWorker
from tests.integration.test_delta_transfer import decode_all
from tests.integration.test_model_families import build_checkpoint, save_tokenizer
from tests.integration.test_tensor_parallel import CHECKPOINTS
from worker.config import WorkerConfig
from worker.runtime import build_resources

pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SIZES = (1, 2, 4)
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)]
BS = 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(300, 300 + n)) for n in (5, 40, 97)]   # a partial block; 3 blocks; 7 blocks
# when each prefill worker posts its writes (`WorkerConfig.kv_send`): both ways at TP 1 and above
KV_SEND = {1: "layer", 2: "pass", 4: "layer"}


def _config(role: str, path, tp: int, engine: str = "tcp", **kw) -> WorkerConfig:
    return WorkerConfig(role=role, model=str(path), weights="fp32", transfer_engine=engine, num_blocks=64,
                        block_size=BS, tensor_parallel_size=tp, threads=1, **kw)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer_dir):
    return build_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), tokenizer_dir, CHECKPOINTS["qwen2"])


def greedy(loaded, prompts) -> dict:
    """The TP-1 engine's tokens for each prompt."""
    gen = build_generator(loaded, CacheConfig(block_size=BS, num_blocks=64))
    return {tuple(p): gen.generate([p], PARAMS)[0].token_ids for p in prompts}


@pytest.fixture(scope="module")
def reference(qwen2):
    return greedy(load_model(qwen2, weights="fp32"), PROMPTS)


@pytest.fixture(scope="module")
def groups(qwen2):
    """Prefill and decode workers at each of `SIZES`, every prefill worker connected to every
    decode worker ("d<tp>"); all closed on exit, their rank processes checked gone."""
    with contextlib.ExitStack() as stack:
        decode, prefill = {}, {}
        for tp in SIZES:
            arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
            res = build_resources(_config("decode", qwen2, tp), arrivals)
            stack.callback(res.close)
            decode[tp] = DecodeWorker(res, arrivals)
            stack.callback(decode[tp].close)
        for tp in SIZES:
            res = build_resources(_config("prefill", qwen2, tp, kv_send=KV_SEND[tp]))
            stack.callback(res.close)
            prefill[tp] = PrefillWorker(res)
            stack.callback(prefill[tp].close)
            for dtp, d in decode.items():
                prefill[tp].connect(f"d{dtp}", d.res.endpoint())
        ranks = [p for w in (*decode.values(), *prefill.values()) for p in getattr(w.res.loaded.model, "ranks", [])]
        assert len(ranks) == 2 * sum(tp - 1 for tp in SIZES)
        yield prefill, decode
    # stopped by close: each follower's data plane closed (tp-rank-sender joined) and exit code 0;
    # rank 0's events threads end with the pipes
    assert [p.poll() for p in ranks] == [0] * len(ranks)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tp-events")]


@contextlib.contextmanager
def pair(path, a: int, b: int, engine: str = "tcp"):
    """A prefill worker at TP ``a`` connected (as "d") to a decode worker at TP ``b``."""
    with contextlib.ExitStack() as stack:
        arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
        dres = build_resources(_config("decode", path, b, engine), arrivals)
        stack.callback(dres.close)
        decode = DecodeWorker(dres, arrivals)
        stack.callback(decode.close)
        pres = build_resources(_config("prefill", path, a, engine))
        stack.callback(pres.close)
        prefill = PrefillWorker(pres)
        stack.callback(prefill.close)
        prefill.connect("d", dres.endpoint())
        yield prefill, decode


def _serve(prefill: PrefillWorker, decode: DecodeWorker, dst: str, rid: str, prompt: list[int]):
    r = decode.reserve(rid, len(prompt), PARAMS.max_tokens, prompt)
    job = prefill.submit(rid, prompt, PARAMS, dst, r.blocks, r.transfer.slot, r.transfer.generation)
    return r, job


@pytest.mark.parametrize("a,b", PAIRS)
def test_kv_between_tp_sizes_decodes_the_tp1_tokens(groups, reference, a, b):
    check_pair(groups[0][a], groups[1][b], f"d{b}", reference, 4)


@pytest.mark.parametrize("tp", [1, 2])
def test_writes_are_posted_at_each_layer_or_once_the_pass_ends(groups, reference, tp):
    """``kv_send``: "layer" posts each layer's writes as it finishes, "pass" every layer's in one
    call after the pass (rank 0's calls recorded; the followers' writes are counted in by the
    decode worker's completion, `check_pair`); the decoded tokens are the reference's either way."""
    prefill, calls = groups[0][tp], []
    post = prefill.sender.post_layers

    def recording(layers, jobs):
        calls.append(list(layers))
        post(layers, jobs)

    prefill.sender.post_layers = recording
    try:
        check_pair(prefill, groups[1][1], "d1", {k: v for k, v in reference.items() if len(k) == 40}, 4)
    finally:
        del prefill.sender.post_layers
    num_layers = prefill.res.layout.num_layers
    assert calls == ([[layer] for layer in range(num_layers)] if KV_SEND[tp] == "layer" else [list(range(num_layers))])


def test_smollm2_written_by_tp3_prefill_into_tp1_decode(smollm):
    prompts = [smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in ("What is the capital of France?", "Write a haiku about the sea. " * 3)]
    with pair(smollm.path, 3, 1) as (prefill, decode):
        check_pair(prefill, decode, "d", greedy(smollm, prompts), 3)


def test_moe_at_tp2_on_both_sides(tmp_path, tokenizer_dir):
    path = build_checkpoint("qwen3_moe", tmp_path, tokenizer_dir, CHECKPOINTS["qwen3_moe"])
    with pair(path, 2, 2) as (prefill, decode):
        check_pair(prefill, decode, "d", greedy(load_model(path, weights="fp32"), PROMPTS), 4)


def check_pair(prefill: PrefillWorker, decode: DecodeWorker, dst: str, reference: dict, kv_heads: int) -> None:
    """Serve every prompt of ``reference`` at once (one prefill pass): each prefill's write count
    and bytes are the plan's, the decoded tokens the reference's, and both pools end full."""
    a, b = prefill.res.tp_size, decode.res.tp_size
    started = [(_serve(prefill, decode, dst, f"r{a}{b}-{i}", list(p)), list(p)) for i, p in enumerate(reference)]
    layout = decode.res.layout
    for (r, job), p in started:
        assert job.finished.wait(120)
        res = job.result()
        # one write per (layer, K|V, KV head) of the model: the blocks are one run on both sides
        assert res.num_writes == 2 * layout.num_layers * kv_heads
        assert res.bytes_written == -(-len(p) // BS) * layout.bytes_per_block // layout.num_kv_heads * kv_heads
        assert decode_all(decode, r.request_id, res, p, PARAMS) == reference[tuple(p)], (a, b, len(p))
    deadline = time.monotonic() + 10
    while prefill.res.pool.allocator.num_free < prefill.res.pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.res.pool.allocator.num_free == prefill.res.pool.num_blocks
    assert decode.res.pool.allocator.num_free == decode.res.pool.num_blocks


def test_a_lost_rank_frees_no_block_while_a_rank_of_its_group_lives(smollm):
    """A decode worker's failed transfer touched by one rank of a TP-2 writer group: when that
    rank is killed (kill -9: its connection drops) its group mate, alive and connected, could
    still write, so the blocks stay quarantined (`DecodeWorker.add_writer_group`); when the mate
    then closes its engine (BYE on both its tcp streams, as a lost TP worker's rank 0 does on its
    way out) no writer of the group is left and the blocks return at once, long before the
    quarantine ends (`DecodeArrivals.on_peer_gone`). The ranks here are a looping writer process
    and an engine of this process: two endpoints of one group as the decode worker learns it at
    Connect."""
    from kvtransfer import EndpointInfo, create_engine
    from kvtransfer_helpers import engine_config, spawn_writer

    quarantine = 60.0
    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    res = build_resources(WorkerConfig(role="decode", transfer_engine="tcp", num_blocks=64, quarantine_s=quarantine,
                                       prefill_timeout_s=quarantine / 2, secret=engine_config().secret), arrivals, smollm)
    decode = DecodeWorker(res, arrivals)
    mate = create_engine("tcp", engine_config(streams_per_peer=2))
    try:
        r = decode.reserve("victim", 100, 4)
        t = r.require_transfer()
        ids = list(r.blocks)
        proc, pipe, writer_id = spawn_writer("tcp", res.endpoint().to_bytes(), 64, (ids, ids, 64, t.slot, t.generation))
        mate.connect(EndpointInfo.from_bytes(res.endpoint().to_bytes()))   # connected, writes nothing yet
        decode.add_writer_group([writer_id, mate.describe().endpoint_id])
        assert pipe.poll(60) and pipe.recv() == "started"
        deadline = time.monotonic() + 10
        while writer_id not in decode.counter.writers(t.slot, t.generation) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode.abort("victim")   # the writer is not known to have stopped: quarantined
        free = res.pool.allocator.num_free
        assert free == res.pool.num_blocks - len(ids)
        started = time.monotonic()
        proc.kill()
        proc.join(30)
        deadline = time.monotonic() + 2
        while writer_id not in arrivals.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer_id in arrivals.lost
        time.sleep(1.0)
        assert res.pool.allocator.num_free == free   # its group mate lives: still quarantined
        mate.close()   # gracefully: BYE, no connection lost
        while res.pool.allocator.num_free < res.pool.num_blocks and time.monotonic() < started + 10:
            time.sleep(0.1)
        assert res.pool.allocator.num_free == res.pool.num_blocks   # back long before the quarantine's end
        assert mate.describe().endpoint_id in arrivals.lost
    finally:
        mate.close()
        decode.close()
        res.close()


def test_a_failed_transfers_blocks_return_once_every_writer_that_could_write_is_gone(smollm):
    """The blocks of a transfer failed before its KV was in return as soon as every writer that
    could still write into them has lost its connection, whatever the order of the losses and the
    failure (`DecodeWorker._fail`, `_writer_lost`); the quarantine is far longer than the test:
    - the writer named at Reserve (the router names the prefill worker) wrote nothing yet: the
      blocks stay while it lives, and return when it is killed;
    - a TP-2 group whose silent rank was killed before the failure, and whose writing rank after:
      the blocks stay while the writing rank lives, and return when it is killed (the earlier
      loss is not waited for a second time)."""
    from kvtransfer_helpers import engine_config, spawn_writer

    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    res = build_resources(WorkerConfig(role="decode", transfer_engine="tcp", num_blocks=64, quarantine_s=600.0,
                                       prefill_timeout_s=300.0, secret=engine_config().secret), arrivals, smollm)
    decode = DecodeWorker(res, arrivals)
    blob, full, procs = res.endpoint().to_bytes(), res.pool.num_blocks, []

    def spawn(plan_args=None) -> str:
        proc, pipe, endpoint_id = spawn_writer("tcp", blob, 64, plan_args)
        procs.append(proc)
        assert pipe.poll(60) and pipe.recv() == "started"
        return endpoint_id

    def kill(i: int, endpoint_id: str) -> None:
        procs[i].kill()
        procs[i].join(30)
        deadline = time.monotonic() + 10
        while endpoint_id not in arrivals.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint_id in arrivals.lost

    def num_free_after(seconds: float) -> int:
        deadline = time.monotonic() + seconds
        while res.pool.allocator.num_free < full and time.monotonic() < deadline:
            time.sleep(0.05)
        return res.pool.allocator.num_free

    try:
        named = spawn()
        r = decode.reserve("named", 100, 4, writers=[named])
        assert decode.abort("named")   # writer not known to have stopped
        assert num_free_after(1.0) == full - len(r.blocks)   # it lives: quarantined
        kill(0, named)
        assert num_free_after(10.0) == full

        mate = spawn()
        r = decode.reserve("group", 100, 4)
        t, ids = r.require_transfer(), list(r.blocks)
        writer = spawn((ids, ids, 64, t.slot, t.generation))
        decode.add_writer_group([writer, mate])
        deadline = time.monotonic() + 30
        while writer not in decode.counter.writers(t.slot, t.generation) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer in decode.counter.writers(t.slot, t.generation)   # it touched the blocks
        kill(1, mate)
        assert decode.abort("group")
        assert num_free_after(1.0) == full - len(ids)   # the writing rank lives: quarantined
        kill(2, writer)
        assert num_free_after(10.0) == full
    finally:
        for proc in procs:
            proc.kill()
            proc.join(30)
        decode.close()
        res.close()
