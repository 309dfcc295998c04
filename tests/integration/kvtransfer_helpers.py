"""Helpers for the kvtransfer integration tests: a receiver (decode-side) process driven over a pipe.

The receiver runs in a spawned process with its own engine, KV pool and CompletionCounter; the
test process is the writer (or spawns one it can kill). Comparisons go by SHA-256 of gathered
blocks, so hundreds of MB never cross the pipe.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any

import torch

from rdmalab.config import in_lab

SECRET = b"kvtransfer-test-secret-0123456789"
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; float32; block_size 16. Inside the RDMA lab
# the pools hold 6 of the 30 layers: every byte there moves through the emulated CPU (Soft-RoCE
# copies, hashing), and a layer's plan is the same shape with fewer layers.
SMOL = dict(num_layers=6 if in_lab() else 30, block_size=16, num_kv_heads=3, head_dim=64)


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return (SMOL["num_layers"], 2, SMOL["num_kv_heads"], num_blocks, SMOL["block_size"], SMOL["head_dim"])


def blocks_digest(pool: torch.Tensor, block_ids: list[int]) -> str:
    """SHA-256 of ``pool[:, :, :, block_ids]`` (all layers, K and V, heads), in id order."""
    gathered = pool[:, :, :, torch.tensor(block_ids, dtype=torch.long, device=pool.device)].contiguous().cpu()
    return hashlib.sha256(gathered.view(torch.uint8).numpy().tobytes()).hexdigest()


def engine_config(**overrides: Any) -> Any:
    """The tests' EngineConfig; ``verbs`` may be a dict of VerbsConfig fields."""
    from kvtransfer import EngineConfig, VerbsConfig

    verbs = overrides.pop("verbs", None)
    if isinstance(verbs, dict):
        overrides["verbs"] = VerbsConfig(**verbs)
    return EngineConfig(secret=SECRET, **overrides)


def _receiver_main(conn: Any, engine_name: str, num_blocks: int, dtype_name: str,
                   overrides: dict | None = None, device: str = "cpu") -> None:
    from kvtransfer import CompletionCounter, allocate_shared_buffer, create_engine

    dtype = getattr(torch, dtype_name)
    shape = pool_shape(num_blocks)
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    done_events: list[tuple[int, int, int]] = []
    counter = CompletionCounter(64, on_done=lambda s, g, st: done_events.append((s, g, int(st))))
    peers: list[tuple[str, str]] = []   # ("connected" | "gone", writer), in order
    counter.on_peer_connected = lambda source: peers.append(("connected", source))
    counter.on_peer_gone = lambda source: peers.append(("gone", source))
    engine = create_engine(engine_name, engine_config(**(overrides or {})), arrivals=counter)
    if device != "cpu":   # a GPU pool: staged by tcp/shm, exported by cuda_ipc
        raw, shared = torch.zeros(nbytes, dtype=torch.uint8, device=device), None
    else:
        raw, shared = allocate_shared_buffer(nbytes) if engine_name in ("shm", "auto") else (
            torch.zeros(nbytes, dtype=torch.uint8), None)
    pool = raw.view(dtype).view(shape)
    region = engine.register_memory(raw, shared=shared)
    conn.send(engine.describe().to_bytes())
    handlers = {
        "acquire": lambda deadline: counter.acquire(deadline),
        "expect": lambda slot, gen, n, source=None: counter.expect(slot, gen, n, source),
        "release": lambda slot, gen: counter.release(slot, gen),
        "state": lambda slot: (int(counter.state(slot).state), counter.state(slot).received),
        "digest": lambda ids: blocks_digest(pool, ids),
        "bytes_digest": lambda off, n: hashlib.sha256(raw[off:off + n].cpu().numpy().tobytes()).hexdigest(),
        "stats": lambda: (asdict(engine.stats()), asdict(counter.stats()), list(done_events)),
        "region_key": lambda: region.key,
        "zero": lambda: raw.zero_() is None,
        "qp_states": lambda: engine.qp_states() if engine_name == "verbs" else {},
        "peers": lambda: list(peers),
    }
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "wait":
                slot, gen, timeout = args
                start = time.monotonic()
                try:
                    counter.wait(slot, gen, timeout)
                    conn.send(("ok", ("complete", None, time.monotonic() - start)))
                except Exception as exc:  # the test inspects the type
                    conn.send(("ok", (type(exc).__name__, str(exc), time.monotonic() - start)))
            elif cmd == "close":
                engine.close()
                if shared is not None:
                    shared.close()
                conn.send(("ok", [t.name for t in threading.enumerate()]))
                return
            else:
                conn.send(("ok", handlers[cmd](*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Receiver:
    """Handle on a receiver process: ``call(cmd, *args)`` runs a command there."""

    def __init__(self, engine_name: str, num_blocks: int, dtype: str = "float32",
                 overrides: dict | None = None, start_method: str = "spawn", device: str = "cpu") -> None:
        ctx = mp.get_context(start_method)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main,
                                args=(child, engine_name, num_blocks, dtype, overrides, device),
                                name=f"kv-receiver-{engine_name}", daemon=True)
        self.proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("receiver did not start")
        self.endpoint_blob: bytes = self._conn.recv()
        self.num_blocks = num_blocks

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"receiver did not answer {cmd}")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver failed {cmd}:\n{value}")
        return value

    def close(self) -> list[str]:
        names = self.call("close")
        self.proc.join(10)
        return names


def _writer_main(conn: Any, engine_name: str, blob: bytes, num_blocks: int, plan_args: tuple,
                 overrides: dict | None = None, device: str = "cpu") -> None:
    """A writer that connects, then posts the same transfer in a loop until killed; with
    ``plan_args`` None it stays connected and writes nothing (a rank that has not written yet)."""
    from kvtransfer import (EndpointInfo, KVLayout, create_engine, pack_immediate, plan_writes,
                            to_write_ops)

    pool = torch.randn(pool_shape(num_blocks), device=device)
    engine = create_engine(engine_name, engine_config(**(overrides or {})))
    local = engine.register_memory(pool)
    info = EndpointInfo.from_bytes(blob)
    peer = engine.connect(info)
    if plan_args is None:
        conn.send(engine.describe().endpoint_id)
        conn.send("started")
        while True:
            time.sleep(1.0)
    src_ids, dst_ids, dst_blocks, slot, gen = plan_args
    layout = KVLayout.from_tensor(pool)
    dst_layout = KVLayout(layout.num_layers, dst_blocks, layout.block_size, layout.num_kv_heads,
                          layout.head_dim, layout.itemsize)
    plan = plan_writes(layout, dst_layout, src_ids, dst_ids, 1 << 16)
    ops = to_write_ops(plan, local, info.regions[0].key, pack_immediate(slot, gen))
    conn.send(engine.describe().endpoint_id)
    first = True
    while True:
        for i in range(0, len(ops), 64):
            handle = engine.post_writes(peer, ops[i:i + 64])
            if first:
                conn.send("started")
                first = False
            engine.wait(handle, 30)


def spawn_writer(engine_name: str, blob: bytes, num_blocks: int, plan_args: tuple | None,
                 overrides: dict | None = None, start_method: str = "spawn",
                 device: str = "cpu") -> tuple[Any, Any, str]:
    """Start a looping writer; returns (process, pipe, its endpoint id). Waits up to 300 s for
    it to describe itself: a process that imports torch takes a minute or more under the RDMA
    lab's emulated CPU (a forkserver with torch preloaded forks it in a second)."""
    ctx = mp.get_context(start_method)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_writer_main,
                       args=(child, engine_name, blob, num_blocks, plan_args, overrides, device),
                       name="kv-writer", daemon=True)
    proc.start()
    if not parent.poll(300):
        proc.kill()
        raise RuntimeError("writer did not start within 300 s")
    return proc, parent, parent.recv()
