"""Two-process kvtransfer tests: a receiver process (decode side) and this process as the writer,
for the tcp and shm engines: what their wire format adds to the engine contract (out-of-order
frames, mixed good/bad batches, auth, grouped acks). The contract itself (every engine, verbs
included) is test_kvtransfer_contract.py."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

from kvtransfer import (AuthError, EndpointInfo, EngineConfig, KVLayout, PeerLostError, RemoteAccessError,
                        TransportKind, WriteOp, count_writes, create_engine, pack_immediate,
                        plan_writes, to_write_ops)
from kvtransfer.frame import Frame, FrameFlag, FrameType
from kvtransfer_helpers import (SECRET, Receiver, blocks_digest, pool_shape,
                                                  spawn_writer)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DST_BLOCKS = 560   # decode pool: holds an 8192-token prompt (512 blocks) plus spare
SRC_BLOCKS = 540   # prefill pool: a different size on purpose
MAX_WRITE = 1 << 20


@pytest.fixture(scope="module", params=["tcp", "shm"])
def engine_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def receiver(engine_name):
    rx = Receiver(engine_name, DST_BLOCKS)
    yield rx
    if rx.proc.is_alive():
        names = rx.close()
        assert not [n for n in names if n.startswith("kv-")], names


@pytest.fixture(scope="module")
def writer(engine_name, receiver):
    torch.manual_seed(0)
    pool = torch.randn(pool_shape(SRC_BLOCKS))
    engine = create_engine(engine_name, EngineConfig(secret=SECRET))
    local = engine.register_memory(pool)
    info = EndpointInfo.from_bytes(receiver.endpoint_blob)
    peer = engine.connect(info)
    yield engine, pool, local, peer, info
    engine.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


def layouts(pool: torch.Tensor) -> tuple[KVLayout, KVLayout]:
    src = KVLayout.from_tensor(pool)
    dst = KVLayout(src.num_layers, DST_BLOCKS, src.block_size, src.num_kv_heads, src.head_dim, src.itemsize)
    return src, dst


def chunked(rng: random.Random, total: int, n: int) -> list[int]:
    """``n`` distinct ids of ``range(total)`` in shuffled runs of 1-4 consecutive ids."""
    chunks, start = [], 0
    while start < total:
        k = rng.randint(1, 4)
        chunks.append(list(range(start, min(start + k, total))))
        start += k
    rng.shuffle(chunks)
    return [b for c in chunks for b in c][:n]


def scattered_ids(rng: random.Random, num_tokens: int) -> tuple[list[int], list[int]]:
    """Non-contiguous ids with some consecutive runs, as a real allocator would hand out."""
    n = -(-num_tokens // 16)
    return chunked(rng, SRC_BLOCKS, n), chunked(rng, DST_BLOCKS, n)


def transfer(writer, receiver, src_ids, dst_ids, *, shuffle=False, expect_first=True, seed=0):
    engine, pool, local, peer, info = writer
    src_layout, dst_layout = layouts(pool)
    slot, gen = receiver.call("acquire", 30.0)
    n = count_writes(src_layout, dst_layout, src_ids, dst_ids, MAX_WRITE)
    if expect_first:
        receiver.call("expect", slot, gen, n)
    handles = []
    layer_order = list(range(src_layout.num_layers))
    if shuffle:
        random.Random(seed).shuffle(layer_order)
    total = 0
    for layer in layer_order:   # layer by layer, as prefill does
        plan = plan_writes(src_layout, dst_layout, src_ids, dst_ids, MAX_WRITE, layers=range(layer, layer + 1))
        ops = to_write_ops(plan, local, info.regions[0].key, pack_immediate(slot, gen))
        if shuffle:
            ops = list(ops)   # a `WriteOps` is immutable: a reordered batch is a list
            random.Random(seed + layer).shuffle(ops)
        total += len(ops)
        handles.append(engine.post_writes(peer, ops))
    assert total == n
    for h in handles:
        assert engine.wait(h, 60).num_writes > 0
    if not expect_first:
        assert receiver.call("state", slot)[1] == n   # everything arrived before the count is known
        receiver.call("expect", slot, gen, n)
    result = receiver.call("wait", slot, gen, 60.0)
    assert result[0] == "complete", result
    assert receiver.call("digest", dst_ids) == blocks_digest(pool, src_ids)
    receiver.call("release", slot, gen)
    return slot, gen


@pytest.mark.parametrize("num_tokens", [1, 300, 8192])   # 17 and 2048: test_kvtransfer_contract.py
def test_kv_shaped_transfer_is_byte_exact(writer, receiver, num_tokens):
    src_ids, dst_ids = scattered_ids(random.Random(num_tokens), num_tokens)
    before = receiver.call("stats")[1]["completed"]
    slot, gen = transfer(writer, receiver, src_ids, dst_ids)
    engine_stats, counter_stats, done = receiver.call("stats")
    assert counter_stats["completed"] == before + 1
    assert done.count((slot, gen, 2)) == 1   # on_done fired exactly once for this acquisition


def test_out_of_order_and_count_learned_late(writer, receiver):
    src_ids, dst_ids = scattered_ids(random.Random(7), 1000)
    transfer(writer, receiver, src_ids, dst_ids, shuffle=True, expect_first=False, seed=3)


def test_bad_key_and_out_of_bounds_are_rejected(engine_name, writer, receiver):
    engine, pool, local, peer, info = writer
    key = info.regions[0].key
    length = info.regions[0].length
    receiver.call("zero")
    digest = receiver.call("bytes_digest", 0, 1 << 20)
    tail = receiver.call("bytes_digest", length - 4096, 4096)
    rejected_before = receiver.call("stats")[0]["writes_rejected"] + engine.stats().writes_rejected
    bad = [WriteOp(local, 0, key ^ 0x5A5A5A5A, 0, 4096, pack_immediate(1, 0)),
           WriteOp(local, 0, key, length - 1024, 4096, pack_immediate(1, 0))]
    for op in bad:
        with pytest.raises(RemoteAccessError):
            engine.wait(engine.post_writes(peer, [op]), 30)
    assert receiver.call("bytes_digest", 0, 1 << 20) == digest
    assert receiver.call("bytes_digest", length - 4096, 4096) == tail
    rejected_after = receiver.call("stats")[0]["writes_rejected"] + engine.stats().writes_rejected
    assert rejected_after == rejected_before + 2
    # A rejected write in the middle of a batch (payload larger than any scratch buffer) leaves
    # the stream in sync: the good writes around it land, the bad one lands nowhere.
    receiver.call("zero")
    good = pool.view(torch.uint8).view(-1)
    mixed = [WriteOp(local, 0, key, 0, 1 << 20), WriteOp(local, 0, key ^ 1, 0, 3_000_001),
             WriteOp(local, 1 << 20, key, 1 << 20, 1 << 20)]
    with pytest.raises(RemoteAccessError):
        engine.wait(engine.post_writes(peer, mixed), 30)
    ok = engine.post_writes(peer, [WriteOp(local, 2 << 20, key, 2 << 20, 1 << 20)])
    engine.wait(ok, 30)
    expected = __import__("hashlib").sha256(good[:3 << 20].numpy().tobytes()).hexdigest()
    if engine_name == "tcp":   # tcp applies the valid writes of a batch; shm rejects the batch
        assert receiver.call("bytes_digest", 0, 3 << 20) == expected
    else:
        zeros = __import__("hashlib").sha256(bytes(2 << 20)).hexdigest()
        assert receiver.call("bytes_digest", 0, 2 << 20) == zeros
        assert receiver.call("bytes_digest", 2 << 20, 1 << 20) == __import__("hashlib").sha256(
            good[2 << 20:3 << 20].numpy().tobytes()).hexdigest()
    with pytest.raises(RemoteAccessError):   # local range outside the local region: refused at post
        engine.post_writes(peer, [WriteOp(local, local.length - 10, key, 0, 4096)])


def test_unauthenticated_peers_are_rejected(engine_name, receiver):
    info = EndpointInfo.from_bytes(receiver.endpoint_blob)
    receiver.call("zero")
    before = receiver.call("stats")[0]["auth_failures"]
    pool = torch.ones(1 << 16, dtype=torch.uint8)
    with create_engine(engine_name, EngineConfig(secret=b"not-the-right-secret!")) as rogue:
        rogue.register_memory(pool)
        with pytest.raises(AuthError):
            rogue.connect(info)
    # A raw client that skips the handshake and sends a write frame straight away.
    frame = Frame(FrameType.WRITE, FrameFlag.HAS_IMM, info.regions[0].key, 0, 0, 4096).pack() + bytes(4096)
    if engine_name == "tcp":
        addr = info.transport(TransportKind.TCP)
        raw = socket.create_connection((addr.host, addr.port))
    else:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect("\0" + info.transport(TransportKind.SHM).path[1:])
    raw.sendall(frame * 4)
    raw.settimeout(10)
    try:   # the receiver hangs up (EOF or reset): no fds, no acks
        assert raw.recv(1 << 16) == b""
    except ConnectionResetError:
        pass
    raw.close()
    deadline = time.monotonic() + 10
    while receiver.call("stats")[0]["auth_failures"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.call("stats")[0]["auth_failures"] == before + 2
    assert receiver.call("bytes_digest", 0, 1 << 16) == receiver.call("bytes_digest", 1 << 16, 1 << 16)
    assert receiver.call("bytes_digest", 0, 4096) == __import__("hashlib").sha256(bytes(4096)).hexdigest()


@pytest.mark.parametrize("attributed", [True, False])
def test_writer_killed_mid_transfer_fails_slot_within_deadline(engine_name, receiver, attributed):
    deadline = 8.0
    slot, gen = receiver.call("acquire", deadline)
    ids = list(range(0, 512))
    proc, pipe, writer_id = spawn_writer(engine_name, receiver.endpoint_blob, SRC_BLOCKS,
                                         (ids, ids, DST_BLOCKS, slot, gen))
    try:
        # Attributed: decode knows which prefill writes the slot (fails on disconnect at once).
        # Unattributed: learned from the first arrival, or the deadline catches it.
        receiver.call("expect", slot, gen, 10 ** 9, writer_id if attributed else None)
        assert pipe.poll(60) and pipe.recv() == "started"
        time.sleep(0.3)
        proc.kill()
        kind, message, elapsed = receiver.call("wait", slot, gen, 30.0)
    finally:
        proc.kill()
        proc.join(10)
    assert kind in ("PeerLostError", "TransferTimeout"), message
    assert elapsed < deadline + 1.0
    if attributed:
        assert kind == "PeerLostError" and elapsed < 5.0, (kind, elapsed)
    receiver.call("release", slot, gen)


def test_grouped_parts_are_acked_each_with_its_own_status():
    """A writer's group of three batch parts sent back to back (two frames; the middle part spans
    both and has one write out of bounds) gets one ACK per part, in order, each with its own
    status; the good writes land, the bad one nowhere. Driven by a raw client speaking the wire
    format to a real tcp receiver, so the grouping is deterministic."""
    from kvtransfer import ImmediateQueue, MemoryRegion, auth
    from kvtransfer.frame import HEADER, HEADER_SIZE, MAX_DESCS, T_ACK, T_WRITE, WireStatus, group_frames
    arrivals = ImmediateQueue()
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    with create_engine("tcp", EngineConfig(secret=SECRET), arrivals=arrivals) as rx:
        key = rx.register_memory(pool).key
        local = MemoryRegion(src.data_ptr(), src.numel(), 1)
        part5 = [WriteOp(local, i * 64, key, i * 64, 64, 0x105) for i in range(2)]
        part6 = [WriteOp(local, 4096 + i * 64, key, 4096 + i * 64, 64, 0x106) for i in range(MAX_DESCS + 10)]
        part6.insert(MAX_DESCS + 5, WriteOp(local, 0, key, pool.numel() - 10, 64, 0x106))   # in frame 2
        part7 = [WriteOp(local, 1 << 19, key, 1 << 19, 4096, 0x107)]
        addr = rx.describe().transport(TransportKind.TCP)
        with socket.create_connection((addr.host, addr.port), timeout=30) as sock:
            auth.client_handshake(sock, SECRET, "raw-writer")
            frames = group_frames(T_WRITE, [(part5, 5), (part6, 6), (part7, 7)])
            assert len(frames) == 2
            for frame, ops in frames:
                sock.sendall(frame + b"".join(src[op.local_offset:op.local_offset + op.length].numpy().tobytes()
                                              for op in ops))
            acks = b""
            while len(acks) < 3 * HEADER_SIZE:
                chunk = sock.recv(3 * HEADER_SIZE - len(acks))
                assert chunk, "receiver closed before acking"
                acks += chunk
            got = [HEADER.unpack_from(acks, i * HEADER_SIZE) for i in range(3)]
            assert [(a[2], a[9], a[4], a[8]) for a in got] == [
                (T_ACK, 5, WireStatus.OK, 0), (T_ACK, 6, WireStatus.OUT_OF_BOUNDS, 1), (T_ACK, 7, WireStatus.OK, 0)]
            sock.sendall(Frame(FrameType.BYE).pack())
        good = part5 + [op for op in part6 if op.remote_offset < pool.numel() - 10] + part7
        for op in good:
            assert torch.equal(pool[op.remote_offset:op.remote_offset + op.length],
                               src[op.local_offset:op.local_offset + op.length])
        assert not pool[pool.numel() - 10:].any()
        imms = [arrivals.immediates.get(timeout=5)[0] for _ in range(len(good))]
        assert imms == [op.imm for op in good] and arrivals.immediates.empty()
        assert rx.stats().writes_rejected == 1 and rx.stats().writes_received == len(good)
        assert arrivals.gone.get(timeout=5) == "raw-writer" and arrivals.lost.empty()   # BYE: gone, not lost


def test_a_writer_is_gone_once_its_last_connection_ends_closed_or_lost(engine_name):
    """The receiver tells its arrivals when a writer has no connection left (`PeerConnections`):
    a writer engine with two tcp streams (or one shm connection) is connected once, and gone
    once, only after its close (BYE after its writes) ended every one of them, never lost; a
    connection dropped without BYE is lost, then gone. The decode worker frees quarantined
    blocks on gone (`DecodeArrivals`)."""
    from kvtransfer import ImmediateQueue, allocate_shared_buffer, auth
    arrivals = ImmediateQueue()
    if engine_name == "shm":   # shm writes only into shared memory
        pool, shared = allocate_shared_buffer(1 << 16)
    else:
        pool, shared = torch.zeros(1 << 16, dtype=torch.uint8), None
    with create_engine(engine_name, EngineConfig(secret=SECRET), arrivals=arrivals) as rx:
        key = rx.register_memory(pool, shared=shared).key
        src = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint8)
        info = EndpointInfo.from_bytes(rx.describe().to_bytes())
        with create_engine(engine_name, EngineConfig(secret=SECRET, streams_per_peer=2)) as tx:
            writer_id = tx.describe().endpoint_id
            peer = tx.connect(info)
            tx.wait(tx.post_writes(peer, [WriteOp(tx.register_memory(src), 0, key, 0, 1 << 16, 0x42)]), 30)
            assert arrivals.connected.get(timeout=10) == writer_id
            assert arrivals.gone.empty()
        assert arrivals.gone.get(timeout=10) == writer_id
        assert arrivals.connected.empty() and arrivals.gone.empty() and arrivals.lost.empty()
        assert torch.equal(pool, src) and arrivals.immediates.get(timeout=5) == (0x42, writer_id)

        addr = rx.describe().transport(TransportKind(engine_name))
        if engine_name == "tcp":
            sock = socket.create_connection((addr.host, addr.port), timeout=30)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect("\0" + addr.path[1:] if addr.path.startswith("@") else addr.path)   # abstract
        with sock:
            auth.client_handshake(sock, SECRET, "dropped-writer")
            assert arrivals.connected.get(timeout=10) == "dropped-writer"
        source, error = arrivals.lost.get(timeout=10)
        assert source == "dropped-writer" and isinstance(error, PeerLostError)   # EOF, or reset (shm's unread fds)
        assert arrivals.gone.get(timeout=10) == "dropped-writer"


def test_failed_batch_among_queued_batches_fails_alone(writer, receiver):
    """Forty batches posted without waiting (the tx thread sends what is queued as groups); the
    one with an out-of-bounds write fails, every other completes and its bytes land."""
    engine, pool, local, peer, info = writer
    key, length = info.regions[0].key, info.regions[0].length
    receiver.call("zero")
    src = pool.view(torch.uint8).view(-1)
    batches = [[WriteOp(local, (b * 8 + i) * 4096, key, (b * 8 + i) * 4096, 4096) for i in range(8)]
               for b in range(40)]
    batches[17] = batches[17][:4] + [WriteOp(local, 0, key, length - 100, 4096)] + batches[17][4:]
    handles = [engine.post_writes(peer, ops) for ops in batches]
    for b, h in enumerate(handles):
        if b == 17:
            with pytest.raises(RemoteAccessError):
                engine.wait(h, 60)
        else:
            assert engine.wait(h, 60).num_writes == 8
    for b in (0, 16, 18, 39):
        start = b * 8 * 4096
        assert receiver.call("bytes_digest", start, 8 * 4096) == __import__("hashlib").sha256(
            src[start:start + 8 * 4096].numpy().tobytes()).hexdigest()
