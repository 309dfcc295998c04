"""The engine contract (kvtransfer/base.py), one suite for every engine: tcp and shm on the host,
verbs on a real RDMA stack (Soft-RoCE in the lab, or the host's device) in two topologies: two
devices over the lab's veth pair (writer rxe0 -> receiver rxe1) and one device to itself; on a
GPU (cuda marker: skipped without one, a failure under PDSERVE_REQUIRE=cuda), cuda_ipc between two
GPU pools and tcp and shm with GPU pools on both sides (staged through host mirrors).

A receiver process (decode side) per engine; this process writes. Wire-format details of tcp and
shm are tested in test_kvtransfer_engines.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing as mp
import random
import threading
import time

import pytest
import torch

from kvtransfer import (EndpointInfo, KVLayout, KVTransferError, RemoteAccessError,
                        TransferError, WriteOp, count_writes, create_engine, pack_immediate, plan_writes,
                        to_write_ops)
from kvtransfer_helpers import Receiver, blocks_digest, engine_config, pool_shape, spawn_writer
from tests.require import unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

DST_BLOCKS, SRC_BLOCKS = 160, 150
MAX_WRITE = 1 << 20
# name -> (engine, receiver overrides, writer overrides)
SETUPS = {
    "tcp": ("tcp", {}, {}),
    "shm": ("shm", {}, {}),
    "verbs-2dev": ("verbs", {"verbs": {"device": "rxe1"}}, {"verbs": {"device": "rxe0"}}),
    "verbs-loop": ("verbs", {"verbs": {"device": "rxe0"}}, {"verbs": {"device": "rxe0"}}),
    "cuda_ipc": ("cuda_ipc", {}, {}),
    "tcp-cuda": ("tcp", {}, {}),
    "shm-cuda": ("shm", {}, {}),
}
GPU = {"cuda_ipc", "tcp-cuda", "shm-cuda"}   # both pools on the GPU


def _marks(name: str) -> list:
    return [pytest.mark.rdma] if name.startswith("verbs") else [pytest.mark.cuda] if name in GPU else []


ALL = [pytest.param(k, marks=_marks(k), id=k) for k in SETUPS]
# One device to itself runs the data-path core (every test costs minutes under the lab's
# emulated CPU); the failure and scale tests run over the two devices.
PARAMS = [p for p in ALL if p.id != "verbs-loop"]
core = pytest.mark.parametrize("setup", ALL, indirect=True)
# In the lab every new process imports torch under emulation (~30-90 s); forkserver pays once.
START = "forkserver"


def _with_device(overrides: dict) -> dict:
    """Name lab devices only where they exist (a host with its own NIC uses its first device)."""
    from kvtransfer.verbs.support import list_rdma_devices
    verbs = overrides.get("verbs")
    if verbs and verbs.get("device") not in list_rdma_devices():
        return {**overrides, "verbs": {k: v for k, v in verbs.items() if k != "device"}}
    return overrides


def _overrides(setup: str, which: int, **extra) -> dict:
    engine, rx, tx = SETUPS[setup]
    base = dict(rx if which == 0 else tx)
    if engine == "verbs":
        base = _with_device(base)
    for key, value in extra.items():
        if key == "verbs":
            base["verbs"] = {**base.get("verbs", {}), **value}
        else:
            base[key] = value
    return base


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    mp.set_forkserver_preload(["torch", "kvtransfer", "kvtransfer_helpers"])


def _device(setup: str) -> str:
    return "cuda" if setup in GPU else "cpu"


@pytest.fixture(scope="module", params=PARAMS)
def setup(request) -> str:
    if request.param in GPU:
        if not torch.cuda.is_available():
            unavailable("cuda", f"no CUDA device: the {request.param} contract cannot run here")
        if request.param == "cuda_ipc" and importlib.util.find_spec("cupy") is None:
            unavailable("cuda", "cuda_ipc needs cupy, which is not installed")
    return request.param


@pytest.fixture(scope="module")
def receiver(setup):
    rx = Receiver(SETUPS[setup][0], DST_BLOCKS, overrides=_overrides(setup, 0), start_method=START,
                  device=_device(setup))
    yield rx
    if rx.proc.is_alive():
        names = rx.close()
        assert not [n for n in names if n.startswith("kv-")], names


@pytest.fixture(scope="module")
def writer(setup, receiver):
    torch.manual_seed(0)
    pool = torch.randn(pool_shape(SRC_BLOCKS), device=_device(setup))
    engine = create_engine(SETUPS[setup][0], engine_config(**_overrides(setup, 1)))
    local = engine.register_memory(pool)
    info = EndpointInfo.from_bytes(receiver.endpoint_blob)
    peer = engine.connect(info)
    yield engine, pool, local, peer, info
    engine.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


def _layouts(pool):
    src = KVLayout.from_tensor(pool)
    return src, KVLayout(src.num_layers, DST_BLOCKS, src.block_size, src.num_kv_heads, src.head_dim, src.itemsize)


def _transfer(writer, receiver, src_ids, dst_ids, seed=0):
    engine, pool, local, peer, info = writer
    src_layout, dst_layout = _layouts(pool)
    slot, gen = receiver.call("acquire", 60.0)
    n = count_writes(src_layout, dst_layout, src_ids, dst_ids, MAX_WRITE)
    handles, total = [], 0
    for layer in range(src_layout.num_layers):   # layer by layer, as prefill does
        plan = plan_writes(src_layout, dst_layout, src_ids, dst_ids, MAX_WRITE, layers=range(layer, layer + 1))
        ops = to_write_ops(plan, local, info.regions[0].key, pack_immediate(slot, gen))
        if layer % 2:   # odd layers as a shuffled list (op by op), even ones as planned (`WriteOps` arrays)
            ops = list(ops)
            random.Random(seed + layer).shuffle(ops)
        total += len(ops)
        handles.append(engine.post_writes(peer, ops))
    assert total == n
    receiver.call("expect", slot, gen, n)
    for h in handles:
        engine.wait(h, 120)
    result = receiver.call("wait", slot, gen, 120.0, timeout=180)
    assert result[0] == "complete", result
    assert receiver.call("digest", dst_ids) == blocks_digest(pool, src_ids)
    receiver.call("release", slot, gen)


def _ids(rng: random.Random, num_tokens: int) -> tuple[list[int], list[int]]:
    n = -(-num_tokens // 16)
    return rng.sample(range(SRC_BLOCKS), n), rng.sample(range(DST_BLOCKS), n)


@pytest.mark.parametrize("num_tokens", [17, 2048])
@core
def test_kv_shaped_plans_arrive_intact_and_are_counted(writer, receiver, num_tokens):
    before = receiver.call("stats")[1]["completed"]
    _transfer(writer, receiver, *_ids(random.Random(num_tokens), num_tokens))
    assert receiver.call("stats")[1]["completed"] == before + 1


@core
def test_stale_generation_is_dropped(writer, receiver):
    engine, pool, local, peer, info = writer
    src_layout, dst_layout = _layouts(pool)
    slot, old_gen = receiver.call("acquire", 30.0)
    receiver.call("release", slot, old_gen)             # abort: the generation bumps
    stale_before = receiver.call("stats")[1]["stale_dropped"]
    plan = plan_writes(src_layout, dst_layout, [0, 1], [10, 11], MAX_WRITE, layers=range(0, 2))
    engine.wait(engine.post_writes(peer, to_write_ops(plan, local, info.regions[0].key,
                                                      pack_immediate(slot, old_gen))), 60)
    deadline = time.monotonic() + 30   # verbs: the immediates are delivered after the writer's CQE
    while receiver.call("stats")[1]["stale_dropped"] < stale_before + len(plan) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert receiver.call("stats")[1]["stale_dropped"] == stale_before + len(plan)
    assert receiver.call("state", slot) == (0, 0)        # FREE, nothing counted


@core
def test_wrong_key_or_out_of_bounds_is_a_typed_error_and_the_peer_recovers(writer, receiver):
    engine, pool, local, peer, info = writer
    key, length = info.regions[0].key, info.regions[0].length
    receiver.call("zero")
    head, tail = receiver.call("bytes_digest", 0, 1 << 20), receiver.call("bytes_digest", length - 8192, 8192)
    for bad in (WriteOp(local, 0, key ^ 0x5A5A5A5A, 0, 4096, pack_immediate(1, 0)),
                WriteOp(local, 0, key, length - 1024, 4096, pack_immediate(1, 0))):
        with pytest.raises(RemoteAccessError):
            engine.wait(engine.post_writes(peer, [bad]), 60)
        # the same connection (re-established underneath where the engine had to) carries on
        engine.wait(engine.post_writes(peer, [WriteOp(local, 0, key, 1 << 21, 4096)]), 60)
    assert receiver.call("bytes_digest", 0, 1 << 20) == head
    assert receiver.call("bytes_digest", length - 8192, 8192) == tail
    _transfer(writer, receiver, *_ids(random.Random(3), 300))
    with pytest.raises(RemoteAccessError):   # a local range outside the local region: refused at post
        engine.post_writes(peer, [WriteOp(local, local.length - 10, key, 0, 4096)])


def test_smallest_receive_capacity_does_not_hang(setup):
    """verbs: 16 receive WQEs in the SRQ against 512 writes with immediates (the writer meets
    RNR NAKs while the receiver refills); tcp/shm: 4 KiB socket buffers. Every handle resolves
    within its deadline, OK or with a typed error, and a transfer after it works."""
    extra = {"verbs": {"srq_depth": 16, "cq_depth": 128}} if SETUPS[setup][0] == "verbs" else {
        "socket_buffer_bytes": 4096}
    # 16 blocks: at least the 2 MiB written below, with the lab's 6-layer pools too
    rx = Receiver(SETUPS[setup][0], 16, overrides=_overrides(setup, 0, **extra), start_method=START,
                  device=_device(setup))
    engine = create_engine(SETUPS[setup][0], engine_config(**_overrides(setup, 1)))
    try:
        src = torch.randint(0, 255, (2 << 20,), dtype=torch.uint8)
        local = engine.register_memory(src.to(_device(setup)))
        info = EndpointInfo.from_bytes(rx.endpoint_blob)
        peer = engine.connect(info)
        key = info.regions[0].key
        slot, gen = rx.call("acquire", 300.0)
        handles = [engine.post_writes(peer, [WriteOp(local, i * 4096, key, i * 4096, 4096, pack_immediate(slot, gen))
                                             for i in range(b * 128, (b + 1) * 128)]) for b in range(4)]
        outcomes = []
        for h in handles:
            try:
                outcomes.append(engine.wait(h, 120).num_writes)
            except KVTransferError as exc:   # typed, never a hang
                outcomes.append(type(exc).__name__)
        assert all(o == 128 or o in ("PeerLostError", "TransferError") for o in outcomes), outcomes
        if all(o == 128 for o in outcomes):
            rx.call("expect", slot, gen, 512)
            assert rx.call("wait", slot, gen, 60.0)[0] == "complete"
        rx.call("release", slot, gen)
        slot, gen = rx.call("acquire", 30.0)
        engine.wait(engine.post_writes(peer, [WriteOp(local, 0, key, 0, 1 << 20, pack_immediate(slot, gen))]), 60)
        rx.call("expect", slot, gen, 1)
        assert rx.call("wait", slot, gen, 60.0)[0] == "complete"
        assert rx.call("bytes_digest", 0, 1 << 20) == hashlib.sha256(src[:1 << 20].numpy().tobytes()).hexdigest()
    finally:
        engine.close()
        rx.close()


def _gone(receiver, writer_id: str, timeout_s: float = 30.0) -> list[str]:
    """What the receiver told its arrivals of ``writer_id`` (``on_peer_connected`` /
    ``on_peer_gone``, in order), once it is gone or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = [kind for kind, source in receiver.call("peers") if source == writer_id]
        if (events and events[-1] == "gone") or time.monotonic() > deadline:
            return events
        time.sleep(0.1)


@core
def test_peer_killed_mid_transfer_surfaces_on_peer_lost(setup, receiver):
    """kill -9 of a writer: the slot it was writing fails with PeerLostError at once, and once
    that is reported nothing more of that writer lands (verbs: its QPs are gone); the writer,
    connected once, is gone once."""
    slot, gen = receiver.call("acquire", 60.0)
    ids = list(range(0, 128))
    proc, pipe, writer_id = spawn_writer(SETUPS[setup][0], receiver.endpoint_blob, SRC_BLOCKS,
                                         (ids, ids, DST_BLOCKS, slot, gen), overrides=_overrides(setup, 1),
                                         start_method=START, device=_device(setup))
    try:
        receiver.call("expect", slot, gen, 10 ** 9, writer_id)
        assert pipe.poll(300) and pipe.recv() == "started"
        time.sleep(0.5)
        proc.kill()
        kind, message, elapsed = receiver.call("wait", slot, gen, 60.0, timeout=120)
    finally:
        proc.kill()
        proc.join(30)
    assert kind == "PeerLostError", (kind, message)
    received = receiver.call("stats")[0]["writes_received"]
    time.sleep(1.0)
    assert receiver.call("stats")[0]["writes_received"] == received
    if SETUPS[setup][0] == "verbs":
        assert receiver.call("stats")[0]["peers_lost"] >= 1
    assert _gone(receiver, writer_id) == ["connected", "gone"]
    receiver.call("release", slot, gen)


def _kv_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kv-")}


def test_close_with_writes_in_flight(setup, receiver):
    before = _kv_threads()
    engine = create_engine(SETUPS[setup][0], engine_config(**_overrides(setup, 1)))
    src = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, device=_device(setup))
    local = engine.register_memory(src)
    info = EndpointInfo.from_bytes(receiver.endpoint_blob)
    peer = engine.connect(info)
    key = info.regions[0].key
    handles = [engine.post_writes(peer, [WriteOp(local, i << 20, key, i << 20, 1 << 20) for i in range(8)])
               for _ in range(16)]
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 30
    for h in handles:
        try:
            assert engine.wait(h, 0).num_writes == 8
        except TransferError:
            pass   # failed with a typed error: fine; neither hanging nor lost
    assert not [t.name for t in _kv_threads() - before]
    _fresh_transfer_works(setup, receiver)


def _fresh_transfer_works(setup, receiver):
    with create_engine(SETUPS[setup][0], engine_config(**_overrides(setup, 1))) as engine:
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        local = engine.register_memory(src.to(_device(setup)))
        info = EndpointInfo.from_bytes(receiver.endpoint_blob)
        peer = engine.connect(info)
        engine.wait(engine.post_writes(peer, [WriteOp(local, 0, info.regions[0].key, 0, 1 << 20)]), 60)
        assert receiver.call("bytes_digest", 0, 1 << 20) == hashlib.sha256(src.numpy().tobytes()).hexdigest()
        writer_id = engine.describe().endpoint_id
    assert _gone(receiver, writer_id) == ["connected", "gone"]   # closed (BYE): every stream ended, then gone


def test_eight_peers_at_once(setup, receiver):
    """Eight writers at once into one receiver, each with a send budget far smaller than what it
    posts (verbs: 48 outstanding sends on a 128-entry CQ against 256 writes): every write lands
    and is counted, no CQ overruns, no handle is lost."""
    extra = {"verbs": {"srq_depth": 16, "cq_depth": 128}} if SETUPS[setup][0] == "verbs" else {}
    info = EndpointInfo.from_bytes(receiver.endpoint_blob)
    key = info.regions[0].key
    engines = [create_engine(SETUPS[setup][0], engine_config(**_overrides(setup, 1, **extra))) for _ in range(8)]
    errors: list[BaseException] = []
    slots = [receiver.call("acquire", 60.0) for _ in range(8)]
    src = torch.randint(0, 255, (8, 1 << 20), dtype=torch.uint8, device=_device(setup))

    def run(i: int) -> None:
        try:
            engine = engines[i]
            local = engine.register_memory(src[i])
            peer = engine.connect(info)
            slot, gen = slots[i]
            ops = [WriteOp(local, j * 4096, key, (i << 20) + j * 4096, 4096, pack_immediate(slot, gen))
                   for j in range(256)]
            engine.wait(engine.post_writes(peer, ops), 180)
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"writer-{i}") for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for slot, gen in slots:
            receiver.call("expect", slot, gen, 256)
            assert receiver.call("wait", slot, gen, 120.0, timeout=180)[0] == "complete"
            receiver.call("release", slot, gen)
        for i in range(8):
            assert receiver.call("bytes_digest", i << 20, 1 << 20) == hashlib.sha256(
                src[i].cpu().numpy().tobytes()).hexdigest()
    finally:
        for engine in engines:
            engine.close()
