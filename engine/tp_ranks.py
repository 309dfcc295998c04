"""The processes of a tensor-parallel model: rank 0 drives, ranks 1 .. N-1 follow.

Rank 0 is the process that serves (a worker, the colocated generator): it loads its shard and
runs the pass like any model, and `TensorParallelModel` first sends every pass to the other ranks,
so each runs the same pass on its own shard and KV pool; the pass's collectives
(`engine.tp.TPGroup`) then meet. Ranks 1 .. N-1 are subprocesses it starts (``python -m
engine.tp_follower``, named ``pdserve-tp-r<r>``: its ``/proc/<pid>/comm``) that load their shard, build
their pool when told, and run what they receive until told to stop.

Wire: a ``torch.distributed`` TCPStore on 127.0.0.1 (rank 0 the master, an ephemeral port) for the
rendezvous and the ranks' load results, and one process group (gloo on the CPU) bound to
127.0.0.1 for the collectives and the commands (a command is pickled and broadcast from rank 0:
its length, then its bytes). Each follower also holds the write end of a pipe to rank 0 (its
*events*: pickled messages, read by rank 0's ``tp-events-r<r>`` thread): replies to `call` and
whatever its rank extension reports (`TensorParallelModel.on_event`).

Rank extension: a worker gives ``start`` the import path of a factory (``"module:name"``) that
each follower calls as ``factory(rank, size, send)`` (``send(msg)`` puts a message on its
events); the object it returns takes part in the follower's life (`engine.tp_follower`): its
pool's buffer and the pool (``pool_buffer(nbytes)``, ``pool_ready(pool)``), the commands rank 0
sends with `TensorParallelModel.call` (``call(name, arg) -> result``), a pass's layer hook when
rank 0's layer callback is a `LayerWork` (``layer_hook(work)`` then ``after_pass(work)``), and
``close()`` at stop. The engine knows nothing of what it does (the workers' data plane:
`worker.tp_rank`).

Failure: a follower exits on any error and when rank 0's process is gone (a watchdog thread,
``tp-parent-watch``); the connections it held close, so rank 0's next collective or command
fails, and `TensorParallelModel` raises `engine.errors.TensorParallelError`, kills the ranks left
and refuses every later pass: a group with a rank gone is gone as a whole.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.config import CacheConfig
from engine.errors import ModelLoadError, TensorParallelError
from engine.kv_cache import KVPool
from engine.tp import TPGroup, local_config

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
START_TIMEOUT_S = 600.0
"""Seconds rank 0 waits for every rank to load its shard."""
IDLE_TIMEOUT = datetime.timedelta(days=7)
"""The process group's per-operation timeout: followers wait in a broadcast between passes, for
as long as the worker is idle. A rank that dies closes its sockets and fails the others' pending
operations at once; this bounds only a rank that hangs."""


def make_group(store, rank: int, size: int, device: str = "cpu") -> TPGroup:
    """The process groups of ``size`` ranks over ``store``: gloo bound to 127.0.0.1 for the
    commands, and for the model's collectives too on the CPU; NCCL for those on CUDA (each rank
    on its own device, `rank_device`)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    opts._timeout = IDLE_TIMEOUT
    pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, opts)
    group = pg
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = IDLE_TIMEOUT
        group = dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl", store), rank, size, nccl_opts)
    return TPGroup(rank, size, group, pg)


def rank_device(device: str, rank: int) -> str:
    """The device of TP rank ``rank`` when the model runs on ``device``: the CPU for every rank;
    on CUDA, one GPU per rank from ``device``'s index on (``cuda:1`` at TP 2: ranks on 1 and 2)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + rank}"


class TensorParallelModel:
    """Rank 0 of a model sharded over N processes: a `engine.models.base.CausalLM` whose passes
    run on every rank.

    Attributes:
        config: the whole model's `ModelConfig`; ``local_config``: rank 0's shapes (its KV heads:
            what `create_pool` gives every rank).
        ranks: the follower processes, ranks 1 .. N-1.
    Its KV pool must come from `create_pool` (each rank builds its own of the same blocks); a pass
    over another pool raises ValueError. After a rank is lost every call raises
    `TensorParallelError`. Calls from several threads are serialized (a pass and ``close``): the
    ranks must meet in the same order.
    """

    def __init__(self, local, group: TPGroup, ranks: list[subprocess.Popen], store,
                 events: list[Connection] | None = None):
        self._local = local
        self.group = group
        self.ranks = ranks
        self._store = store
        self.config = local.config
        self.device = local.device
        self.kv_dtype = local.kv_dtype
        self.local_config = local_config(self.config, group.size)
        self._pool: KVPool | None = None
        self._lost: str | None = None
        self._lock = threading.RLock()
        self.on_event = None
        """``on_event(rank, msg)``: a follower's extension reported ``msg`` (called on that
        rank's events thread; must not block for long)."""
        self.on_lost = None
        """``on_lost(reason)``: the group was lost (a rank exited, a pass failed); called once."""
        self._replies: dict[int, dict[int, object]] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._failing = threading.Lock()   # `_fail`: one thread gives the group up, the others wait
        self._gone: set[int] = set()
        self._closing = False
        self._readers = [threading.Thread(target=self._read_events, args=(r, conn), name=f"tp-events-r{r}",
                                          daemon=True) for r, conn in enumerate(events or [], 1)]
        for t in self._readers:
            t.start()

    @property
    def lost(self) -> str | None:
        """Why the group is unusable (``"closed"`` after `close`), or None."""
        return self._lost

    @property
    def tp_size(self) -> int:
        return self.group.size

    def kv_layers(self):
        """Rank 0's `LayerKV` per layer (each rank holds as many heads: `engine.tp.local_config`)."""
        return self._local.kv_layers()

    def create_pool(self, cache: CacheConfig, buffer: torch.Tensor | None = None) -> KVPool:
        """Rank 0's KV pool of ``cache`` (its KV heads; over ``buffer`` if given, as
        `engine.kv_cache.KVPool`), every other rank building its own alike. Raises
        TensorParallelError when a rank is gone."""
        with self._lock:
            self._command("pool", cache)
            self._pool = ShardedKVPool(self, self.local_config, cache, buffer=buffer, device=self.device)
            return self._pool

    def forward(self, batch, pool: KVPool, on_layer_done=None) -> torch.Tensor:
        """The pass on every rank; returns the whole vocabulary's logits (rank 0 gathers them).

        Raises:
            ValueError: ``pool`` is not the one `create_pool` made.
            TensorParallelError: a rank is gone (before or during the pass), or this rank's part
                of the pass failed: the other ranks may then wait in a collective it never
                reaches, so the group is given up rather than left out of step.
        """
        if pool is not self._pool:
            raise ValueError("a tensor-parallel model runs over the KV pool its create_pool made")
        with self._lock:
            self._command("forward", (batch, getattr(on_layer_done, "rank_work", None)))
            try:
                return self._local.forward(batch, pool, on_layer_done)
            except Exception as e:   # a collective failed (a rank is gone), or this rank's part did
                raise self._fail(f"a pass failed: {type(e).__name__}: {e}") from e

    def warm_up(self, pool: KVPool) -> float:
        """Nothing to build (tensor-parallel layers run eagerly): 0.0."""
        return 0.0

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Every rank copies its K/V of blocks ``src`` into ``dst`` (`ShardedKVPool.copy_blocks`)."""
        with self._lock:
            self._command("copy_blocks", (list(src), list(dst)))

    def call(self, name: str, arg=None, timeout_s: float = 60.0) -> list:
        """Run ``name`` on every follower's rank extension (``ext.call(name, arg)``); returns their
        results, ranks 1 .. N-1 in order.

        Raises:
            the first follower's exception (by rank) when its extension raised one: the group
                stays usable;
            TensorParallelError: a rank is gone, or did not answer within ``timeout_s`` seconds
                (the group is then given up).
        """
        with self._lock:
            seq = next(self._seq)
            with self._cond:
                self._replies[seq] = {}
            self._command("call", (seq, name, arg))
            deadline = time.monotonic() + timeout_s
            with self._cond:
                while len(self._replies[seq]) < len(self.ranks):
                    if self._gone or time.monotonic() > deadline:
                        self._replies.pop(seq)
                        why = "a rank exited" if self._gone else f"no answer within {timeout_s} s"
                        raise self._fail(f"call {name!r}: {why}")
                    self._cond.wait(0.05)
                got = self._replies.pop(seq)
        for r in sorted(got):
            if isinstance(got[r], BaseException):
                raise got[r]
        return [got[r] for r in sorted(got)]

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the followers (a stop command; those still running after ``timeout_s`` seconds are
        killed), join the events threads and leave the group. Idempotent."""
        with self._lock:
            self._closing = True   # the ranks' exits that follow are no loss
            if self._lost is None:
                try:
                    self._command("stop", None)
                except TensorParallelError:
                    pass
                with self._failing:   # a loss `_fail` recorded meanwhile keeps its reason
                    self._lost = self._lost or "closed"
        _reap(self.ranks, timeout_s)
        for t in self._readers:
            t.join(timeout=5)
        self.group.group = self.group.commands = None

    def _read_events(self, rank: int, conn: Connection) -> None:
        """Rank ``rank``'s events until its pipe closes (it exited): replies to `call`, the rest
        to `on_event`. A rank gone while the group is in use loses the group."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:   # noqa: BLE001 - an unpicklable message: the follower is broken
                log.exception("tensor-parallel rank %d sent an unreadable event", rank)
                break
            if msg[0] == "reply":
                with self._cond:
                    if msg[1] in self._replies:
                        self._replies[msg[1]][rank] = msg[2]
                    self._cond.notify_all()
                continue
            handler = self.on_event
            if handler is None:
                log.warning("tensor-parallel rank %d: event %r with no handler", rank, msg[0])
                continue
            try:
                handler(rank, msg)
            except Exception:   # noqa: BLE001 - the handler's bug must not end the events
                log.exception("handling tensor-parallel rank %d's event %r", rank, msg[0])
        conn.close()
        with self._cond:
            self._gone.add(rank)
            self._cond.notify_all()
        if self._lost is None and not self._closing:
            self._fail(f"rank {rank} is gone")

    def _command(self, name: str, arg) -> None:
        if self._lost is not None:
            raise TensorParallelError(f"tensor-parallel group unusable: {self._lost}")
        try:
            broadcast_object(self.group, (name, arg))
        except RuntimeError as e:
            raise self._fail(f"sending {name!r} to the ranks failed: {e}") from e

    def _fail(self, why: str) -> TensorParallelError:
        """Give the group up (once, whichever thread finds the loss first: a rank's events
        thread or a pass): the ranks left are killed and reaped before `lost` says so, so no
        caller learns of the loss while a rank of the group still runs; a second caller waits
        for the first. Returns the error to raise."""
        first = False
        with self._failing:
            if self._lost is None:
                time.sleep(0.05)   # let an exiting rank's code be seen
                dead = [f"rank {r} exit code {p.poll()}" for r, p in enumerate(self.ranks, 1) if p.poll() is not None]
                lost = f"{why} ({', '.join(dead) or 'no rank exited yet'})"
                log.error("tensor-parallel group lost: %s", lost)
                _reap(self.ranks, 0.0)
                self._lost, first = lost, True
        if first and self.on_lost is not None:
            self.on_lost(self._lost)
        return TensorParallelError(self._lost)


class ShardedKVPool(KVPool):
    """Rank 0's KV pool in a tensor-parallel group: its own KV heads; a block copy is made on
    every rank (`copy_blocks`)."""

    def __init__(self, owner: TensorParallelModel, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._owner = owner

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._owner.copy_blocks(src, dst)
        super().copy_blocks(src, dst)


class LayerWork:
    """A layer callback for `TensorParallelModel.forward` that also carries ``work`` for the other
    ranks: each follower's rank extension gets it (``layer_hook(work)``) and runs its own hook at
    each of its layers. ``callback(layer)`` (or None) is rank 0's own."""

    def __init__(self, callback, work):
        self.callback = callback
        self.rank_work = work

    def __call__(self, layer: int) -> None:
        if self.callback is not None:
            self.callback(layer)


def broadcast_object(group: TPGroup, obj=None):
    """Rank 0: send ``obj`` (pickled) to every rank; others: receive and return it. Raises
    RuntimeError (torch.distributed) when a rank is gone."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg = group.commands if group.commands is not None else group.group
    if group.rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    pg.broadcast([size], opts).wait()
    if group.rank != 0:
        data = torch.empty(int(size), dtype=torch.uint8)
    pg.broadcast([data], opts).wait()
    return obj if group.rank == 0 else pickle.loads(data.numpy().tobytes())


def start(path, weights: str, size: int, device: str, threads: int, gemv_copies: bool, build,
          extension: str | None = None):
    """Start ranks 1 .. ``size - 1`` and build rank 0's shard: the `TensorParallelModel`.

    Args:
        path: the resolved model file or directory; weights: a resolved `WEIGHT_MODES` key.
        threads: torch threads of each follower (rank 0 keeps its own).
        build: ``build(path, weights, device, gemv_copies, tp) -> CausalLM`` (`engine.loader`),
            called on every rank with its `TPGroup` (whose process group is not connected yet
            while loading: shards are loaded first, then the group forms).
        extension: ``"module:factory"`` of the followers' rank extension (module doc), or None.
    Raises:
        ModelLoadError: a rank could not load its shard (its message), or the model cannot be
            split ``size`` ways.
        TensorParallelError: a rank exited or did not report within `START_TIMEOUT_S`.
    """
    store = dist.TCPStore(HOST, 0, size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                          wait_for_workers=False)
    spec = {"path": str(path), "weights": weights, "size": size, "device": device, "threads": threads,
            "gemv_copies": gemv_copies, "port": store.port, "parent": os.getpid(), "extension": extension}
    ranks, events = [], []
    try:
        for r in range(1, size):
            read, write = os.pipe()
            events.append(Connection(read, writable=False))
            try:
                ranks.append(subprocess.Popen([sys.executable, "-m", "engine.tp_follower",
                                               json.dumps({**spec, "rank": r, "events_fd": write})], pass_fds=(write,)))
            finally:
                os.close(write)
        local = build(path, weights, rank_device(device, 0), gemv_copies, TPGroup(0, size))
        _wait_loaded(store, ranks)
        group = make_group(store, 0, size, rank_device(device, 0))
        local.tp.group, local.tp.commands = group.group, group.commands
    except BaseException:
        _reap(ranks, 0.0)
        for conn in events:
            conn.close()
        raise
    log.info("tensor parallel: %d ranks (followers pid %s)", size, [p.pid for p in ranks])
    return TensorParallelModel(local, local.tp, ranks, store, events)


def _wait_loaded(store, ranks: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = set(range(1, len(ranks) + 1))
    while waiting:
        for r in sorted(waiting):
            if store.check([f"loaded/{r}"]):
                result = store.get(f"loaded/{r}").decode()
                if result != "ok":
                    raise ModelLoadError(f"tensor-parallel rank {r}: {result}")
                waiting.discard(r)
            elif ranks[r - 1].poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {r} exited with code {ranks[r - 1].returncode} "
                                          "while loading its shard")
        if waiting and time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not load within {START_TIMEOUT_S} s")
        time.sleep(0.05)


def _reap(ranks: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` seconds for the followers to exit, then kill those left."""
    deadline = time.monotonic() + timeout_s
    for p in ranks:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
