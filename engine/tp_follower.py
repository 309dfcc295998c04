"""A tensor-parallel follower rank's process: ``python -m engine.tp_follower SPEC`` (started by
`engine.tp_ranks.start`; SPEC is its JSON: model, weights, device, threads, rank, size, the
rendezvous port and rank 0's pid).

It names itself ``pdserve-tp-r<rank>`` (``/proc/<pid>/comm``), loads its shard, reports the result
through the rendezvous store, joins the group and runs the commands rank 0 broadcasts
(`engine.tp_ranks.broadcast_object`: ``pool``, ``forward``, ``copy_blocks``, ``call``) until
``stop`` (exit 0). Its rank extension, when SPEC names one (`engine.tp_ranks`, "Rank
extension"), takes part as that module describes; its messages and the replies to ``call`` go up
the events pipe (SPEC's ``events_fd``). Any error ends the process (exit 1) so that rank 0 sees the group broken rather than a
hang; rank 0's death ends it too (the ``tp-parent-watch`` thread; exit 3); SIGTERM exits at once.
"""

from __future__ import annotations

import ctypes
import datetime
import importlib
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.errors import TensorParallelError
from engine.kv_cache import KVPool
from engine.loader import build_model, set_torch_threads
from engine.tp import TPGroup, local_config
from engine.tp_ranks import HOST, START_TIMEOUT_S, broadcast_object, make_group, rank_device


def _set_name(name: str) -> None:
    """This process's name as ps and /proc/<pid>/comm show it (Linux ``PR_SET_NAME``, 15 bytes)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15])
    except (OSError, AttributeError):
        pass


def _watch_parent(parent: int) -> None:
    """Exit this follower as soon as rank 0's process is gone (re-parented)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


class Events:
    """The write end of this rank's events pipe to rank 0; ``send`` may be called from any thread."""

    def __init__(self, fd: int):
        self._conn = Connection(fd, readable=False)
        self._lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        """Send ``msg`` (picklable; ``msg[0]`` its kind). Raises OSError when rank 0 is gone."""
        with self._lock:
            self._conn.send(msg)


def _extension(spec: dict, send):
    """The rank extension SPEC names (``"module:factory"``), built, or None."""
    if not spec.get("extension"):
        return None
    module, _, name = spec["extension"].partition(":")
    return getattr(importlib.import_module(module), name)(spec["rank"], spec["size"], send)


def _reply(result) -> object:
    """``result`` as it can travel up the pipe: an exception that does not pickle becomes a
    RuntimeError with its text."""
    if isinstance(result, BaseException):
        try:
            pickle.dumps(result)
        except Exception:   # noqa: BLE001
            return RuntimeError(f"{type(result).__name__}: {result}")
    return result


def follow(spec: dict) -> None:
    """A follower's life (module doc): load its shard, report, join the group, run the commands
    rank 0 broadcasts until ``stop``. Raises whatever failed (the process then exits with 1)."""
    rank, size = spec["rank"], spec["size"]
    _set_name(f"pdserve-tp-r{rank}")
    threading.Thread(target=_watch_parent, args=(spec["parent"],), name="tp-parent-watch", daemon=True).start()
    events = Events(spec["events_fd"])
    set_torch_threads(spec["threads"])
    store = dist.TCPStore(HOST, spec["port"], size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    try:
        model = build_model(spec["path"], spec["weights"], rank_device(spec["device"], rank), spec["gemv_copies"],
                            TPGroup(rank, size))
    except Exception as e:   # noqa: BLE001 - reported to rank 0, which raises it
        store.set(f"loaded/{rank}", f"{type(e).__name__}: {e}")
        raise
    ext = _extension(spec, events.send)
    store.set(f"loaded/{rank}", "ok")
    group = make_group(store, rank, size, rank_device(spec["device"], rank))
    model.tp.group, model.tp.commands = group.group, group.commands
    pool = None
    while True:
        name, arg = broadcast_object(group)
        if name == "forward":
            batch, work = arg
            hook = ext.layer_hook(work) if ext is not None and work is not None else None
            model.forward(batch, pool, hook)
            if hook is not None:
                ext.after_pass(work)
        elif name == "pool":
            config = local_config(model.config, size)
            buffer = ext.pool_buffer(KVPool.nbytes_for(config, arg)) if ext is not None else None
            pool = KVPool(config, arg, buffer=buffer, device=model.device)
            if ext is not None:
                ext.pool_ready(pool)
        elif name == "copy_blocks":
            pool.copy_blocks(*arg)
        elif name == "call":
            seq, what, call_arg = arg
            try:
                if ext is None:
                    raise TensorParallelError(f"rank {rank} has no extension to run {what!r}")
                result = ext.call(what, call_arg)
            except Exception as e:   # noqa: BLE001 - rank 0 raises it; this rank goes on
                result = e
            events.send(("reply", seq, _reply(result)))
        elif name == "stop":
            if ext is not None:
                ext.close()
            return
        else:
            raise TensorParallelError(f"unknown command {name!r}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with torch.inference_mode():
        follow(json.loads(sys.argv[1]))
