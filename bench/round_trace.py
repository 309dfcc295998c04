"""Where one transfer's time goes: a round of writes between two processes, every step stamped.

    python -m bench.round_trace [--kind shm|tcp|cuda_ipc] [--writes 512] [--write-bytes 4096]
                                [--rounds 20] [--json PATH]

A receiver process (its pool registered with a `CompletionCounter`) and this process (the writer)
run ``--rounds`` transfers of ``--writes`` writes of ``--write-bytes`` each, one at a time, after
one untimed round; ``cuda_ipc`` puts both pools on the GPU. The engines' own methods are wrapped
in both processes (this script's doing: the engines carry no tracing) to stamp, on the host's
monotonic clock that both processes share (`time.perf_counter_ns`):

- writer: ``post`` (`post_writes` called), ``posted`` (it returned), ``tx woke`` (the stream's tx
  thread took the batch), ``send`` / ``sent`` (the transport's ``send_batches``: frames, copies),
  ``flush`` / ``flushed`` (cuda_ipc: waiting for the copies' events and sending the NOTIFYs),
  ``ack`` (the ACK thread completing the batch), ``waited`` (`wait` returned);
- receiver: ``frame`` (a frame's descriptors read, before their checks), ``checked``, ``placed``,
  ``delivered`` (immediates counted), ``accounted`` (ACK sent), ``counted`` (the bench's wait on
  the counter returned).

Each stamp's median offset from ``post`` over the rounds (the first of its name in a round; a
batch over 1 MiB is striped over the peer's streams, whose steps then interleave) is printed, in
order, beside a round trip between the two processes over a pipe (each end blocked
in ``recv``: the host's wake-up cost). `bench.gpu` runs it on the GPU host for cuda_ipc and shm.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import statistics
import threading
import time

import torch

from bench.common import arg_parser, write_json

SECRET = b"bench-trace-secret-0123456789abcd"
_STAMPS: list[tuple[int, str]] = []


def _stamp(name: str) -> None:
    _STAMPS.append((time.perf_counter_ns(), name))   # list.append is atomic under the GIL


def _wrap(owner, attr: str, before: str | None, after: str | None) -> None:
    """Replace ``owner.attr`` by a function stamping ``before`` on entry and ``after`` on exit."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if before:
            _stamp(before)
        try:
            return fn(*args, **kwargs)
        finally:
            if after:
                _stamp(after)
    setattr(owner, attr, traced)


def _install(role: str) -> None:
    """Wrap the engines' methods for ``role`` ("writer" or "receiver") in this process."""
    from kvtransfer import connection, cuda_ipc, shm, software, tcp, tracker

    if role == "writer":
        _wrap(software.SoftwareEngine, "post_writes", "post", "posted")
        _wrap(connection.OutboundStream, "_take_group", "tx woke", None)
        _wrap(tracker.CompletionTracker, "parts_done", "ack", None)
        init = connection.OutboundStream.__init__

        @functools.wraps(init)
        def traced_init(self, sock, name, shared, peer, threads, send_batches, flush=None):
            def send(*a):
                _stamp("send")
                try:
                    return send_batches(*a)
                finally:
                    _stamp("sent")

            def flushed(*a):
                _stamp("flush")
                try:
                    return flush(*a)
                finally:
                    _stamp("flushed")
            init(self, sock, name, shared, peer, threads, send, flushed if flush is not None else None)
        connection.OutboundStream.__init__ = traced_init
        return
    _wrap(connection, "check_descs", "frame", "checked")
    _wrap(connection.InboundConnection, "_deliver", None, "delivered")
    _wrap(connection.InboundConnection, "_account", None, "accounted")
    for inbound in (shm._ShmInbound, tcp._TcpInbound, cuda_ipc._IpcInbound):
        _wrap(inbound, "_place", None, "placed")


def _pool(kind: str, nbytes: int):
    from kvtransfer import allocate_shared_buffer

    if kind == "shm":
        return allocate_shared_buffer(nbytes)
    device = "cuda" if kind == "cuda_ipc" else "cpu"
    return torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device), None


def _receiver(conn, nbytes: int, kind: str) -> None:
    from kvtransfer import CompletionCounter, EngineConfig, create_engine

    _install("receiver")
    counter = CompletionCounter(4)
    engine = create_engine(kind, EngineConfig(secret=SECRET), arrivals=counter)
    pool, shared = _pool(kind, nbytes)
    engine.register_memory(pool, shared=shared)
    conn.send(engine.describe().to_bytes())
    while (cmd := conn.recv()) is not None:
        if cmd == "ping":
            conn.send("pong")
            continue
        _STAMPS.clear()
        slot, gen = counter.acquire(60.0)
        counter.expect(slot, gen, cmd)
        conn.send((slot, gen))
        counter.wait(slot, gen, 120.0)
        _stamp("counted")
        counter.release(slot, gen)
        conn.send(list(_STAMPS))
    engine.close()


def trace_rounds(kind: str = "shm", writes: int = 512, write_bytes: int = 4096, rounds: int = 20,
                 streams: int | None = None) -> dict:
    """Run the rounds (module doc); returns ``{"kind", "writes", "write_bytes", "rounds",
    "round_trip_us", "steps": [{"step", "us"}, ...]}`` with each step's median offset from
    ``post`` in microseconds, in order. ``streams``: the writer's streams per peer (default: the
    engine's, `EngineConfig.streams_per_peer`). Raises what the engines raise."""
    from kvtransfer import EndpointInfo, EngineConfig, MemoryRegion, create_engine, pack_immediate
    from kvtransfer.base import WriteOps

    import numpy as np

    nbytes = writes * write_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, nbytes, kind), name="bench-trace-receiver", daemon=True)
    proc.start()
    child.close()   # ours: a receiver that dies then reads as EOFError, not a hang
    _install("writer")
    try:
        info = EndpointInfo.from_bytes(parent.recv())
        src, shared = _pool(kind, nbytes)
        config = EngineConfig(secret=SECRET) if streams is None else EngineConfig(secret=SECRET, streams_per_peer=streams)
        engine = create_engine(kind, config)
        local: MemoryRegion = engine.register_memory(src, shared=shared)
        peer = engine.connect(info)
        offsets = np.arange(writes, dtype=np.int64) * write_bytes
        rows = np.stack([offsets, offsets, np.full(writes, write_bytes, dtype=np.int64)], axis=1)
        per_step: dict[str, list[float]] = {}
        for r in range(rounds + 1):
            parent.send(writes)
            slot, gen = parent.recv()
            ops = WriteOps(local, info.regions[0].key, pack_immediate(slot, gen), rows)
            _STAMPS.clear()
            _stamp("post")
            handle = engine.post_writes(peer, ops)
            engine.wait(handle, 120.0)
            _stamp("waited")
            stamps = sorted(_STAMPS + parent.recv())
            if r == 0:
                continue   # warm-up
            t0 = next(t for t, name in stamps if name == "post")
            seen: set[str] = set()
            for t, name in stamps:   # before t0: the receiver's last round, after its count
                if t >= t0 and name not in seen:
                    seen.add(name)
                    per_step.setdefault(name, []).append((t - t0) / 1e3)
        engine.close()
        trips = []
        for _ in range(41):
            t = time.perf_counter()
            parent.send("ping")
            parent.recv()
            trips.append((time.perf_counter() - t) * 1e6)
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    steps = sorted(({"step": k, "us": statistics.median(v)} for k, v in per_step.items()), key=lambda s: s["us"])
    return {"kind": kind, "writes": writes, "write_bytes": write_bytes, "rounds": rounds,
            "streams": config.streams_per_peer,
            "round_trip_us": statistics.median(trips), "steps": steps}


def print_trace(t: dict) -> None:
    print(f"{t['kind']}: {t['writes']} writes of {t['write_bytes']} bytes, {t['streams']} stream(s), median of "
          f"{t['rounds']} rounds; "
          f"a round trip between the processes {t['round_trip_us']:.0f} us")
    print("| step | us after post |\n|---|---|")
    for s in t["steps"]:
        print(f"| {s['step']} | {s['us']:.0f} |")


def main(argv=None) -> dict:
    ap = arg_parser("bench.round_trace", __doc__)
    ap.add_argument("--kind", default="shm", choices=["shm", "tcp", "cuda_ipc"])
    ap.add_argument("--writes", type=int, default=512)
    ap.add_argument("--write-bytes", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--streams", type=int, default=None, help="the writer's streams per peer (default: the engine's)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = trace_rounds(args.kind, args.writes, args.write_bytes, args.rounds, args.streams)
    print_trace(result)
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
