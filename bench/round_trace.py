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
  ``delivered`` (immediates counted), ``acking`` (a frame accounted, its ACKs about to go), ``counted``
  (the bench's wait on the counter returned).

The writer asks for the receiver's stamps once its ``wait`` returned, so every stamp of the round
is in (each precedes the ACK that ended the wait, or the count the receiver waited for first).

Each stamp's median offset from ``post`` over the rounds (the first of its name in a round; a
batch over 1 MiB is striped over the peer's streams, whose steps then interleave) is printed, in
order, beside a round trip between the two processes over a pipe (each end blocked
in ``recv``: the host's wake-up cost). `bench.gpu` runs it on the GPU host for cuda_ipc and shm.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch

from bench.common import arg_parser, write_json

SECRET = b"bench-trace-secret-0123456789abcd"

PINGS = 41
"""Exchanges `pipe_round_trip_us` times between a bench and its receiver process (`bench.gpu` and this one)."""


def transfer_pool(kind: str, nbytes: int) -> tuple[torch.Tensor, object]:
    """A pool of ``nbytes`` random bytes for engine ``kind`` and what registering it needs (its
    ``shared`` handle or None): on the GPU for cuda_ipc, in shared memory for shm, host memory
    otherwise."""
    from kvtransfer import allocate_shared_buffer

    if kind == "shm":
        return allocate_shared_buffer(nbytes)
    device = "cuda" if kind == "cuda_ipc" else "cpu"
    return torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device), None


def pipe_round_trip_us(conn) -> float:
    """Median microseconds of `PINGS` "ping" / "pong" exchanges with a receiver process over
    ``conn`` (both ends blocked in ``recv``: the host's wake-up cost)."""
    trips = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        conn.send("ping")
        if conn.recv() != "pong":
            raise RuntimeError("the receiver answered a ping with something else")
        trips.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(trips)

_STAMPS: list[tuple[int, str]] = []


def _stamp(name: str) -> None:
    _STAMPS.append((time.perf_counter_ns(), name))   # list.append is atomic under the GIL


def _traced(fn, before: str | None, after: str | None):
    """``fn``, stamping ``before`` on entry and ``after`` on exit (either may be None)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if before:
            _stamp(before)
        try:
            return fn(*args, **kwargs)
        finally:
            if after:
                _stamp(after)
    return traced


def _install(role: str) -> Callable[[], None]:
    """Wrap the engines' methods for ``role`` ("writer" or "receiver") in this process; returns
    the function that puts the originals back."""
    from kvtransfer import connection, cuda_ipc, shm, software, tcp, tracker

    if role == "writer":
        init = connection.OutboundStream.__init__

        def traced_init(self, sock, name, shared, peer, threads, send_batches, flush=None):
            init(self, sock, name, shared, peer, threads, _traced(send_batches, "send", "sent"),
                 None if flush is None else _traced(flush, "flush", "flushed"))
        wraps = [(software.SoftwareEngine, "post_writes", "post", "posted"),
                 (connection.OutboundStream, "_take_group", "tx woke", None),
                 (tracker.CompletionTracker, "parts_done", "ack", None)]
        replaced = [(connection.OutboundStream, "__init__", traced_init)]
    else:
        wraps = [(connection, "check_descs", "frame", "checked"),
                 (connection.InboundConnection, "_deliver", None, "delivered"),
                 (connection.InboundConnection, "_account", "acking", None),
                 *((inbound, "_place", None, "placed") for inbound in (shm._ShmInbound, tcp._TcpInbound,
                                                                       cuda_ipc._IpcInbound))]
        replaced = []
    replaced += [(owner, attr, _traced(getattr(owner, attr), before, after)) for owner, attr, before, after in wraps]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in replaced]
    for owner, attr, fn in replaced:
        setattr(owner, attr, fn)

    def restore() -> None:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    return restore


def _receiver(conn, nbytes: int, kind: str) -> None:
    from kvtransfer import CompletionCounter, EngineConfig, create_engine

    _install("receiver")   # this process ends with the bench: nothing to put back
    counter = CompletionCounter(4)
    engine = create_engine(kind, EngineConfig(secret=SECRET), arrivals=counter)
    pool, shared = transfer_pool(kind, nbytes)
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
        if conn.recv() != "stamps":
            raise RuntimeError("the writer asked for something else than the round's stamps")
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
    restore = _install("writer")
    try:
        info = EndpointInfo.from_bytes(parent.recv())
        src, shared = transfer_pool(kind, nbytes)
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
            parent.send("stamps")
            stamps = sorted(_STAMPS + parent.recv())
            if r == 0:
                continue   # warm-up
            t0 = next(t for t, name in stamps if name == "post")
            seen: set[str] = set()
            for t, name in stamps:
                if name not in seen:
                    seen.add(name)
                    per_step.setdefault(name, []).append((t - t0) / 1e3)
        engine.close()
        round_trip_us = pipe_round_trip_us(parent)
    finally:
        restore()   # this process's engines untraced again
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    steps = sorted(({"step": k, "us": statistics.median(v)} for k, v in per_step.items()), key=lambda s: s["us"])
    return {"kind": kind, "writes": writes, "write_bytes": write_bytes, "rounds": rounds,
            "streams": config.streams_per_peer,
            "round_trip_us": round_trip_us, "steps": steps}


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
