"""``python -m bench.kvtransfer [--quick] [--json PATH]``: kvtransfer engines vs ceilings and peers.

Every measurement moves the same bytes from a writer (this process) into a receiver (a child of
the forkserver) on loopback:

- ``tcp`` / ``shm``: this package's engines; one iteration posts the shape's writes (KV shapes
  layer by layer, as prefill does) and waits for every local completion, which implies the
  receiver placed the bytes and took the immediates.
- ``memcpy``: the same writes as plain in-process copies (the ceiling of ``shm``).
- ``socket``: one plain TCP stream, ``sendall`` of the shape's bytes and ``recv_into`` one buffer,
  then a 1-byte ack (the ceiling of ``tcp``).
- ``socket-sg``: the same stream, but gathering the shape's actual source ranges with ``sendmsg``
  and scattering them to their destination ranges with ``recvmsg_into`` (no framing, no checks):
  the ceiling of a one-sided write of *scattered* blocks over one TCP stream, which is what the
  KV shapes are (on this machine 0.75-0.85x of ``socket`` for the 128-token KV).
- ``nixl-tcp`` / ``nixl-local`` / ``mooncake-tcp``: peers, when importable (see :mod:`bench.kvtransfer_peers`).
- ``verbs``: this package's RDMA engine (``--methods ...,verbs``; ``--verbs-devices RX,TX`` names
  the receiver's and the writer's device). On a software device (Soft-RoCE, as in the RDMA lab,
  whose guest CPU is emulated) the table says so: absolute GB/s then mean nothing, only the
  comparison with tcp measured in the same run does.

Shapes: the KV of 128/512/2048/8192-token prompts in the SmolLM2-135M float32 layout (scattered
blocks), and 1 GiB (``--quick``: 256 MiB) in 256 KiB and 4 MiB writes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from bench import kvtransfer_peers
from bench.common import arg_parser, timed, write_json
from kvtransfer import (EndpointInfo, EngineConfig, KVLayout, VerbsConfig, WriteOp, create_engine,
                        plan_writes)
from kvtransfer.frame import recv_exact_many, send_parts
from kvtransfer.shm import allocate_shared_buffer

SECRET = b"kvtransfer-bench-secret-000000"
SMOL = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, itemsize=4)
MAX_WRITE = 4 << 20


@dataclass
class Shape:
    name: str
    nbytes: int
    batches: list[list[tuple[int, int, int]]]  # per batch: (src_offset, dst_offset, length)


@dataclass
class Result:
    shape: str
    method: str
    nbytes: int
    gbps: float
    p50_ms: float
    p99_ms: float
    iters: int
    ratios: dict[str, float] = field(default_factory=dict)


def kv_shape(tokens: int, pool_bytes: int, rng: random.Random) -> Shape:
    layout = KVLayout(num_blocks=pool_bytes // (60 * 16 * 3 * 64 * 4), **SMOL)
    n = layout.blocks_for_tokens(tokens)
    src, dst = rng.sample(range(layout.num_blocks), n), rng.sample(range(layout.num_blocks), n)
    batches = [[(w.src_offset, w.dst_offset, w.length) for w in
                plan_writes(layout, layout, src, dst, MAX_WRITE, layers=range(l, l + 1))]
               for l in range(layout.num_layers)]
    return Shape(f"kv-{tokens}tok", sum(w[2] for b in batches for w in b), batches)


def bulk_shape(total: int, block: int) -> Shape:
    ops = [(i * block, i * block, block) for i in range(total // block)]
    return Shape(f"{total >> 20}MiB-in-{block >> 10}KiB", total, [ops])


def shapes(quick: bool, pool_bytes: int, names: tuple[str, ...] = ()) -> list[Shape]:
    """The shapes measured (``names``: only those)."""
    rng = random.Random(0)
    total = (128 << 20) if quick else (1 << 30)
    wanted = lambda name: not names or name in names   # noqa: E731
    out = [kv_shape(t, pool_bytes, rng) for t in (128, 512, 2048, 8192) if wanted(f"kv-{t}tok")]
    return out + [s for s in (bulk_shape(total, 256 << 10), bulk_shape(total, 4 << 20)) if wanted(s.name)]


def summarize(shape: Shape, method: str, times: list[float]) -> Result:
    p50 = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))]
    return Result(shape.name, method, shape.nbytes, shape.nbytes / p50 / 1e9, p50 * 1e3, p99 * 1e3, len(times))


# -- receiver process ---------------------------------------------------------------------------
class _Count:
    def __init__(self) -> None:
        self.n = 0

    def on_immediate(self, imm: int, source: str, count: int = 1) -> None:
        self.n += count

    def on_peer_lost(self, source: str, error: Exception) -> None:
        pass

    def on_peer_connected(self, source: str) -> None:
        pass

    def on_peer_gone(self, source: str) -> None:
        pass


def _prefaulted(nbytes: int) -> torch.Tensor:
    """A receive buffer whose pages are already mapped (a fresh allocation faults on first
    write, which would land in the first iterations' times)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    return buf


def _socket_receiver(conn, nbytes: int) -> None:
    """Messages: ``C`` + u64 size (contiguous payload follows), ``T`` + u64 n + n x (u64 offset,
    u64 length) (the scatter table), ``G`` (a payload scattered by the table follows); a 1-byte
    ack after every payload."""
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(_prefaulted(nbytes).numpy())
    head = bytearray(9)
    table: list[tuple[int, int]] = []
    while sock.recv_into(head, 9, socket.MSG_WAITALL) == 9:
        kind, n = head[:1], int.from_bytes(head[1:], "big")
        if kind == b"T":
            raw = bytearray(16 * n)
            sock.recv_into(raw, len(raw), socket.MSG_WAITALL)
            values = np.frombuffer(raw, dtype=">u8").tolist()
            table = list(zip(values[0::2], values[1::2]))
            continue
        if kind == b"C":
            recv_exact_many(sock, [buf[:n]])
        else:
            recv_exact_many(sock, [buf[o:o + length] for o, length in table])
        sock.sendall(b"\x01")


def engine_config(streams: int, verbs_device: str = "") -> EngineConfig:
    return EngineConfig(secret=SECRET, streams_per_peer=streams, verbs=VerbsConfig(device=verbs_device))


def _receiver(conn, kind: str, nbytes: int, streams: int, verbs_device: str = "") -> None:
    if kind == "socket":
        _socket_receiver(conn, nbytes)
        return
    engine = create_engine(kind, engine_config(streams, verbs_device), arrivals=_Count())
    pool, shared = allocate_shared_buffer(nbytes) if kind == "shm" else (_prefaulted(nbytes), None)
    engine.register_memory(pool, shared=shared)
    conn.send(engine.describe().to_bytes())
    conn.recv()
    engine.close()


class ReceiverProcess:
    """A receiver (``_receiver``) in a child of multiprocessing's forkserver, which imports torch
    and kvtransfer once (`main` asks for that preload): each method's receiver then starts without
    a fresh interpreter's imports. The child opens its own engine (sockets, shared memory, verbs
    context) after the fork. ``stop()`` ends it (killed after 30 s)."""

    def __init__(self, kind: str, nbytes: int, streams: int = 4, verbs_device: str = "") -> None:
        ctx = mp.get_context("forkserver")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(child, kind, nbytes, streams, verbs_device), daemon=True)
        self.proc.start()
        self.info = self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# -- methods ------------------------------------------------------------------------------------
def run_memcpy(src: np.ndarray, dst: np.ndarray, shape: Shape, iters: int) -> list[float]:
    s_view, d_view = memoryview(src), memoryview(dst)

    def once() -> None:
        for batch in shape.batches:
            for s, d, n in batch:
                d_view[d:d + n] = s_view[s:s + n]
    return timed(once, iters)


def run_socket(src: np.ndarray, sock: socket.socket, shape: Shape, iters: int) -> list[float]:
    payload = memoryview(src)[:shape.nbytes]
    ack = bytearray(1)

    def once() -> None:
        sock.sendall(b"C" + shape.nbytes.to_bytes(8, "big"))
        sock.sendall(payload)
        sock.recv_into(ack, 1, socket.MSG_WAITALL)
    return timed(once, iters)


def run_socket_sg(src: np.ndarray, sock: socket.socket, shape: Shape, iters: int) -> list[float]:
    writes = [w for batch in shape.batches for w in batch]
    table = np.array([(d, n) for _, d, n in writes], dtype=">u8").tobytes()
    sock.sendall(b"T" + len(writes).to_bytes(8, "big") + table)
    view = memoryview(src)
    ack = bytearray(1)

    def once() -> None:
        sock.sendall(b"G" + bytes(8))
        send_parts(sock, [view[s:s + n] for s, _, n in writes])
        sock.recv_into(ack, 1, socket.MSG_WAITALL)
    return timed(once, iters)


def run_engine(kind: str, src_pool: torch.Tensor, blob: bytes, shape: Shape, iters: int,
               streams: int, verbs_device: str = "") -> list[float]:
    engine = create_engine(kind, engine_config(streams, verbs_device))
    try:
        local = engine.register_memory(src_pool)
        info = EndpointInfo.from_bytes(blob)
        peer = engine.connect(info)
        key = info.regions[0].key
        batches = [[WriteOp(local, s, key, d, n, 1) for s, d, n in b] for b in shape.batches]

        def once() -> None:
            handles = [engine.post_writes(peer, ops) for ops in batches]
            for h in handles:
                engine.wait(h, 120)
        return timed(once, iters)
    finally:
        engine.close()


def verbs_note(tx_dev: str, rx_dev: str) -> str:
    """What the verbs rows measured: the devices, and whether they are software (a software RDMA
    device has a ``parent`` netdev in sysfs: rxe, siw)."""
    from kvtransfer.verbs.support import list_rdma_devices
    first = list_rdma_devices()[0]
    tx, rx = tx_dev or first, rx_dev or first
    software = [d for d in {tx, rx} if os.path.exists(f"/sys/class/infiniband/{d}/parent")]
    note = f"writer {tx} -> receiver {rx}"
    if software:
        note += (f"; {', '.join(sorted(software))} is a software RDMA device (Soft-RoCE): its bytes are moved "
                 "by the CPU, which in the RDMA lab is emulated (QEMU TCG), so absolute GB/s are "
                 "meaningless - only the comparison with tcp in the same run means anything")
    return note


def add_ratios(results: list[Result]) -> None:
    by = {(r.shape, r.method): r for r in results}
    for r in results:
        peers = ("memcpy", "socket", "socket-sg", "nixl-tcp", "nixl-local", "mooncake-tcp")
        for other in peers + (("tcp",) if r.method == "verbs" else ()):
            o = by.get((r.shape, other))
            if o is not None and o is not r:
                r.ratios[other] = r.gbps / o.gbps


def print_table(results: list[Result]) -> None:
    cols = ["memcpy", "socket", "socket-sg", "tcp", "nixl-tcp", "nixl-local", "mooncake-tcp"]
    print(f"{'shape':<22}{'method':<14}{'MB':>9}{'GB/s':>8}{'p50 ms':>9}{'p99 ms':>9}  ratios")
    for r in results:
        ratios = " ".join(f"{k}={r.ratios[k]:.2f}" for k in cols if k in r.ratios)
        print(f"{r.shape:<22}{r.method:<14}{r.nbytes / 1e6:>9.1f}{r.gbps:>8.2f}{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}  {ratios}")


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser("bench.kvtransfer", __doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller totals, fewer iterations (< 1 min)")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--methods", default="memcpy,socket,socket-sg,tcp,shm,peers")
    parser.add_argument("--streams", type=int, default=2, help="tcp streams per peer")
    parser.add_argument("--shapes", default="", help="only these shapes (comma separated names)")
    parser.add_argument("--pool-mib", type=int, default=None,
                        help="pool size per side (default 448 with --quick, else 1024); shapes must fit")
    parser.add_argument("--verbs-devices", default="", metavar="RX,TX",
                        help="verbs: the receiver's and the writer's RDMA device (default: the first)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="passes over every method (default 1 with --quick, else 3); each "
                             "(shape, method) is summarised over the iterations of all passes, so a "
                             "drift of the machine during the run hits every method alike")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    mp.set_forkserver_preload(["torch", "kvtransfer"])   # no effect where the forkserver already runs
    rounds = args.rounds or (1 if args.quick else 3)
    pool_bytes = (args.pool_mib << 20) if args.pool_mib else (448 << 20) if args.quick else (1 << 30)
    kv_iters, bulk_iters = (5, 2) if args.quick else (10, 3)
    all_shapes = shapes(args.quick, pool_bytes, tuple(filter(None, args.shapes.split(","))))
    rx_dev, _, tx_dev = args.verbs_devices.partition(",")
    src_pool = torch.randint(0, 255, (pool_bytes,), dtype=torch.uint8)
    src = src_pool.numpy()
    times: dict[tuple[str, str], list[float]] = {}
    notes: dict[str, str] = {}

    def iters(shape: Shape) -> int:
        return kv_iters if shape.name.startswith("kv") else bulk_iters

    def record(method: str, run: Callable[[Shape], list[float]]) -> None:
        for shape in all_shapes:
            times.setdefault((shape.name, method), []).extend(run(shape))

    for _ in range(rounds):
        if "memcpy" in methods:
            dst = _prefaulted(pool_bytes).numpy()
            record("memcpy", lambda s: run_memcpy(src, dst, s, iters(s)))
            del dst
        for name, run in (("socket", run_socket), ("socket-sg", run_socket_sg)):
            if name in methods:
                rx = ReceiverProcess("socket", pool_bytes)
                with socket.create_connection(("127.0.0.1", rx.info)) as sock:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    record(name, lambda s: run(src, sock, s, iters(s)))
                rx.stop()
        for kind in ("tcp", "shm", "verbs"):
            if kind in methods:
                rx = ReceiverProcess(kind, pool_bytes, args.streams, rx_dev)
                record(kind, lambda s: run_engine(kind, src_pool, rx.info, s, iters(s), args.streams, tx_dev))
                rx.stop()
        if "verbs" in methods:
            notes["verbs"] = verbs_note(tx_dev, rx_dev)
        if "peers" in methods:
            peer_times, notes = kvtransfer_peers.run_all(src_pool, all_shapes, iters)
            for key, t in peer_times.items():
                times.setdefault(key, []).extend(t)
    by_name = {s.name: s for s in all_shapes}
    order = {s.name: i for i, s in enumerate(all_shapes)}
    method_order = ["memcpy", "socket", "socket-sg", "tcp", "shm", "verbs", "nixl-tcp", "nixl-local", "mooncake-tcp"]
    results = [summarize(by_name[shape], method, t) for (shape, method), t in times.items()]
    results.sort(key=lambda r: (order[r.shape], method_order.index(r.method) if r.method in method_order else 99))
    add_ratios(results)
    print_table(results)
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    if args.json:
        write_json(args.json, {"quick": args.quick, "rounds": rounds, "results": [asdict(r) for r in results],
                               "notes": notes}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
