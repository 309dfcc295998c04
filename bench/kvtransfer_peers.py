"""Peer engines for :mod:`bench.kvtransfer`, each measured only when importable (optional extra).

- NIXL (``pip install --no-deps nixl-cu12 nixl``): UCX backend, DRAM descriptors, no progress
  thread; both sides sleep-poll. ``nixl-tcp`` runs with ``UCX_TLS=tcp UCX_NET_DEVICES=lo``,
  ``nixl-local`` with UCX defaults (same-host transports such as cma / shared memory).
- Mooncake Transfer Engine (``pip install mooncake-transfer-engine-non-cuda``): ``tcp`` protocol,
  ``P2PHANDSHAKE`` metadata, synchronous batch writes.

Writer and receiver of every peer run in their own spawned processes (UCX reads its environment
at import). A peer that cannot be imported or fails is reported in the notes, never fatal.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench.common import timed

NIXL_CONFIGS = {"nixl-tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, "nixl-local": {}}
_POLL_S = 0.0001
_MOONCAKE_BATCH = 128   # its batch descriptors are bounded; larger batches return -1


def _nixl_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _nixl_receiver(conn: Any, env: dict[str, str], nbytes: int) -> None:
    os.environ.update(env)
    agent = _nixl_agent("kv-bench-rx")
    buf = torch.empty(nbytes, dtype=torch.uint8).fill_(0)   # pages mapped before timing
    agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), nbytes, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll(_POLL_S):
        agent.get_new_notifs()   # progress the UCX worker (sleep-poll, no progress thread)


def _nixl_writer(conn: Any, env: dict[str, str], nbytes: int, meta: bytes, dst: int,
                 shapes: list[tuple[str, list[list[tuple[int, int, int]]], int]]) -> None:
    os.environ.update(env)
    agent = _nixl_agent("kv-bench-tx")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    base = src.data_ptr()
    agent.register_memory(agent.get_reg_descs([(base, nbytes, 0, "")], "DRAM"))
    remote = agent.add_remote_agent(meta)
    out = {}
    for name, batches, iters in shapes:
        handles = []
        for batch in batches:
            local = agent.get_xfer_descs([(base + s, n, 0) for s, _, n in batch], "DRAM")
            far = agent.get_xfer_descs([(dst + d, n, 0) for _, d, n in batch], "DRAM")
            handles.append(agent.initialize_xfer("WRITE", local, far, remote))

        def once() -> None:
            for h in handles:
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("nixl transfer failed")
            for h in handles:
                while (state := agent.check_xfer_state(h)) != "DONE":
                    if state == "ERR":
                        raise RuntimeError("nixl transfer failed")
                    time.sleep(_POLL_S)
        out[name] = timed(once, iters)
        for h in handles:
            agent.release_xfer_handle(h)
    conn.send(out)


def _mooncake_engine():
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    return engine


def _mooncake_receiver(conn: Any, env: dict[str, str], nbytes: int) -> None:
    engine = _mooncake_engine()
    buf = torch.empty(nbytes, dtype=torch.uint8).fill_(0)   # pages mapped before timing
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}".encode(), buf.data_ptr()))
    conn.recv()


def _mooncake_writer(conn: Any, env: dict[str, str], nbytes: int, session: bytes, dst: int,
                     shapes: list[tuple[str, list[list[tuple[int, int, int]]], int]]) -> None:
    engine = _mooncake_engine()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    base = src.data_ptr()
    if engine.register_memory(base, nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    target = session.decode()
    out = {}
    for name, batches, iters in shapes:
        def once() -> None:
            for batch in batches:
                for i in range(0, len(batch), _MOONCAKE_BATCH):
                    part = batch[i:i + _MOONCAKE_BATCH]
                    rc = engine.batch_transfer_sync_write(target, [base + s for s, _, _ in part],
                                                          [dst + d for _, d, _ in part], [n for _, _, n in part])
                    if rc != 0:
                        raise RuntimeError(f"mooncake batch write returned {rc}")
        out[name] = timed(once, iters)
    conn.send(out)


def _guard(target: Callable[..., None], conn: Any, *args: Any) -> None:
    try:
        target(conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=3)))


def _run_pair(receiver: Callable, writer: Callable, env: dict[str, str], nbytes: int,
              shapes: list, timeout_s: float = 600) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    rconn, rchild = ctx.Pipe()
    wconn, wchild = ctx.Pipe()
    rx = ctx.Process(target=_guard, args=(receiver, rchild, env, nbytes), daemon=True)
    rx.start()
    tx = None
    try:
        if not rconn.poll(120):
            raise RuntimeError("peer receiver did not start")
        first = rconn.recv()
        if isinstance(first, tuple) and first and first[0] == "error":
            raise RuntimeError(first[1])
        meta, dst = first
        tx = ctx.Process(target=_guard, args=(writer, wchild, env, nbytes, meta, dst, shapes), daemon=True)
        tx.start()
        if not wconn.poll(timeout_s):
            raise RuntimeError("peer writer timed out")
        result = wconn.recv()
        if isinstance(result, tuple) and result and result[0] == "error":
            raise RuntimeError(result[1])
        return result
    finally:
        try:
            rconn.send("stop")
        except OSError:
            pass
        for p in (tx, rx):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()


def run_all(src_pool: torch.Tensor, shapes: list, iters: Callable[[Any], int]
            ) -> tuple[dict[tuple[str, str], list[float]], dict[str, str]]:
    """Measure every importable peer on ``shapes``; returns (``{(shape, peer): seconds per
    iteration}``, notes)."""
    nbytes = src_pool.numel()
    plain = [(s.name, s.batches, iters(s)) for s in shapes]
    times: dict[tuple[str, str], list[float]] = {}
    notes: dict[str, str] = {}
    candidates = []
    if importlib.util.find_spec("nixl") is not None:
        candidates += [(name, _nixl_receiver, _nixl_writer, env) for name, env in NIXL_CONFIGS.items()]
    else:
        notes["nixl"] = "not installed (pip install --no-deps nixl-cu12 nixl)"
    if importlib.util.find_spec("mooncake") is not None:
        candidates.append(("mooncake-tcp", _mooncake_receiver, _mooncake_writer, {}))
    else:
        notes["mooncake"] = "not installed (pip install mooncake-transfer-engine-non-cuda)"
    for name, receiver, writer, env in candidates:
        try:
            timings = _run_pair(receiver, writer, env, nbytes, plain)
            times.update({(shape, name): t for shape, t in timings.items()})
        except Exception as exc:   # a peer failing must not sink the benchmark
            notes[name] = f"failed: {str(exc).strip().splitlines()[-1][:300]}"
    return times, notes
