"""Process set-up shared by both roles, and the serve loop.

Lifecycle of a worker process (`serve`):
1. `build_resources`: load the model, allocate the KV pool (in shared memory for a decode worker
   whose engine may use shm), create the transfer engine and register the pool with it.
2. Build the role's `WorkerProcess`: its service on a started gRPC server; register with the
   router and heartbeat.
3. SIGTERM / SIGINT: drain (refuse new work, finish in-flight requests up to a deadline), leave
   the router, stop the gRPC server, close the service and the transfer engine. Exit code 0.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

import grpc
import torch

from engine.config import CacheConfig, compatibility_hash
from engine.kv_cache import KVPool, host_buffer
from engine.loader import LoadedModel, load_model, make_pool, set_torch_threads
from engine.prefill_knee import choose_batch_tokens
from engine.runner import prefix_caching_conflict
from kvtransfer import (ArrivalHandler, EngineConfig, KVLayout, MemoryRegion, TransferEngine, VerbsConfig,
                        allocate_shared_buffer, create_engine)
from kvtransfer.endpoint import EndpointInfo, local_host_id
from kvtransfer.errors import PeerLostError
from kvtransfer.group import GroupEndpoint
from kvtransfer.layout import POOL_LAYOUT
from rpc import PROTOCOL_VERSION
from rpc.auth import TLSFiles
from rpc import pdserve_pb2 as pb
from worker.config import WorkerConfig
from worker.cpu_board import CpuLending, lending_of, pin_to_own_cpus
from worker.kernels import own_thread_counts, set_attention_kernels, warm_pass_primitives
from worker.registration import RegistrationClient
from worker.rpcserver import AioServer

log = logging.getLogger(__name__)

PREFILL_KERNEL_CACHE = 320
"""oneDNN primitives a prefill worker keeps cached (oneDNN's cache and ideep's, each): a pass
reuses ~6 matmul shapes on every layer, at a row count bucketed by `engine.linear.bucket_rows`
(36 buckets up to the default 2048 tokens a pass, 4 projection shapes each per thread count, 1
and 2, fit: `worker.kernels.warm_pass_primitives` builds those up to 512 rows at start-up)."""
MALLOC_ARENAS = 2
"""glibc malloc arenas a prefill worker may create (``M_ARENA_MAX``)."""
_M_ARENA_MAX = -8   # mallopt parameter (glibc malloc.h)


def bound_native_memory(role: str) -> None:
    """Keep a prefill worker's resident memory flat over a long run (docs/PERFORMANCE.md, "Memory
    over a long run"); the decode worker, whose shapes are few, is left as it is.

    Every prefill pass has its own row count (bucketed: `engine.linear.bucket_rows`), and each new
    shape of a oneDNN matmul is a new primitive, cached by oneDNN and by ideep (1024 entries each by
    default, ~0.5-0.8 MB apiece): the caches fill for the first hour or so. Both are bounded to `PREFILL_KERNEL_CACHE` entries
    (through their environment variables, read at their first use: call this before the model is
    loaded; values already in the environment win), and the process gets at most
    `MALLOC_ARENAS` glibc arenas. glibc's mmap threshold is left dynamic: fixing it low (every
    large activation mmapped and unmapped) also bounds the heap's free holes, but halves the
    prefill throughput (`python -m bench.shapes_memory --prefill-speed`)."""
    if role != "prefill":
        return
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(PREFILL_KERNEL_CACHE))
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS)
    except (OSError, AttributeError):   # not glibc: nothing to tune
        pass


@dataclass
class WorkerResources:
    """What every worker holds: model, KV pool, transfer engine and the pool's registration.

    ``lost`` is set (with ``lost_reason``) when the worker cannot serve again (a tensor-parallel
    rank is gone): `serve` then stops the process, and the router retries its requests."""

    config: WorkerConfig
    loaded: LoadedModel
    cache: CacheConfig
    pool: KVPool
    layout: KVLayout
    transfer: TransferEngine
    region: MemoryRegion
    compat_hash: str
    shared: object | None = None
    lost: threading.Event = dataclasses.field(default_factory=threading.Event)
    lost_reason: str = ""
    rank_endpoints: tuple[EndpointInfo, ...] = ()
    """A tensor-parallel worker's ranks 1 .. N-1's endpoints (`worker.tp_rank`)."""
    rank_events: dict[str, Callable[..., None]] = dataclasses.field(default_factory=dict)
    """Handlers of the follower ranks' events, by kind: ``rank_events[msg[0]](rank, *msg[1:])``."""
    lending: CpuLending | None = None
    """This worker's side of the host's CPU board (`worker.cpu_board`), or None."""

    @property
    def tp_size(self) -> int:
        return 1 + len(self.rank_endpoints)

    def endpoint(self) -> GroupEndpoint:
        """This worker's data plane for peers: its ranks' endpoints (`kvtransfer.group`)."""
        return GroupEndpoint((self.transfer.describe(), *self.rank_endpoints), self.loaded.config.num_kv_heads,
                             POOL_LAYOUT)

    def on_rank_event(self, rank: int, msg: tuple) -> None:
        """`engine.tp_ranks.TensorParallelModel.on_event`: dispatch to `rank_events`."""
        handler = self.rank_events.get(msg[0])
        if handler is None:
            log.warning("tensor-parallel rank %d: unhandled event %r", rank, msg[0])
            return
        handler(rank, *msg[1:])

    def lose(self, reason: str) -> None:
        """Mark the worker unable to serve again (``lost``); `serve` stops it."""
        self.lost_reason = self.lost_reason or reason
        log.critical("worker lost: %s", reason)
        self.lost.set()

    def close(self) -> None:
        if self.lending is not None:
            self.lending.close()
        self.transfer.close()
        close = getattr(self.loaded.model, "close", None)
        if close is not None:   # a tensor-parallel model: stop its rank processes
            close()
        if self.shared is not None:
            self.shared.close()


def build_resources(config: WorkerConfig, arrivals: ArrivalHandler | None = None,
                    loaded: LoadedModel | None = None) -> WorkerResources:
    """Load the model and set up the pool + transfer engine (see module docstring).

    Raises:
        ModelLoadError, kvtransfer.EngineUnavailableError, ValueError.
    """
    set_torch_threads(config.threads)
    loaded = loaded or load_model(config.model, config.weights, config.device,
                                 gemv_copies=config.role != "prefill", compiled=not config.enforce_eager,
                                 tensor_parallel_size=config.tensor_parallel_size, threads=config.threads,
                                 tp_extension="worker.tp_rank:RankDataPlane",
                                 low_bit_threads=own_thread_counts(config), linear_backend=config.linear_backend)
    tp = getattr(loaded.model, "tp_size", 1) > 1
    if config.weights == "auto":   # the mode load_model resolved it to (the compatibility hash's)
        config = dataclasses.replace(config, weights=loaded.weights)
    reason = prefix_caching_conflict(loaded.config)
    if config.prefix_caching and reason:
        log.warning("prefix caching turned off: %s", reason)
        config = dataclasses.replace(config, prefix_caching=False)
    cache = CacheConfig(block_size=config.block_size, num_blocks=config.num_blocks, dtype=config.kv_dtype)
    nbytes = KVPool.nbytes_for(loaded.pool_config, cache)   # with TP: rank 0's KV heads
    shared = None
    if config.device != "cpu":  # GPUDirect: the verbs engine registers device memory
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=config.device)
    elif config.role == "decode" and config.transfer_engine in ("auto", "shm"):
        buffer, shared = allocate_shared_buffer(nbytes)
    else:
        buffer = host_buffer(nbytes)
    if tp:   # the followers' pools: in shared memory as rank 0's
        loaded.model.call("kv_buffer", shared is not None)
    pool = make_pool(loaded, cache, buffer)
    set_attention_kernels(config, loaded.model, pool)
    if config.device == "cpu" and hasattr(loaded.model, "projection_kernels"):
        warm_pass_primitives(config, loaded.model)
        if config.role == "prefill" and not config.prefill_batch_tokens and config.enforce_eager and not tp:
            knee, line = choose_batch_tokens(loaded.model, pool, config.threads, config.weights,
                                             config.max_num_batched_tokens)
            log.info("prefill batch tokens: %s", line)
            config = dataclasses.replace(config, prefill_batch_tokens=knee)
    if not config.enforce_eager:
        seconds = loaded.model.warm_up(pool)
        log.info("compiled the model's layers in %.1f s (inductor's cache: %s)", seconds,
                 os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default"))
    verbs = VerbsConfig(device=config.rdma_device, port=config.rdma_port, gid_index=config.rdma_gid_index,
                        mtu=config.rdma_mtu)
    engine_config = EngineConfig(secret=config.secret, bind_host=config.listen_host,
                                 advertise_host=config.advertise_host, port=config.transfer_port,
                                 verbs=verbs)
    transfer = create_engine(config.transfer_engine, engine_config, arrivals)
    region = transfer.register_memory(buffer[:nbytes], shared=shared)
    res = WorkerResources(config, loaded, cache, pool, KVLayout.from_tensor(pool.kv), transfer, region,
                          compatibility_hash(loaded.config, cache, loaded.weights), shared,
                          lending=lending_of(config))
    if tp:
        _start_rank_data_planes(res, arrivals, engine_config)
    return res


def _start_rank_data_planes(res: WorkerResources, arrivals: ArrivalHandler | None, engine_config: EngineConfig) -> None:
    """Every follower rank's own engine over its own pool (`worker.tp_rank`); a decode worker's
    follower arrivals feed ``arrivals``; a lost group loses the worker."""
    model, c = res.loaded.model, res.config
    model.on_event = res.on_rank_event
    model.on_lost = res.lose
    if arrivals is not None:
        res.rank_events["imm"] = lambda rank, imm, source, count: arrivals.on_immediate(imm, source, count)
        res.rank_events["lost"] = lambda rank, source, why: arrivals.on_peer_lost(
            source, PeerLostError(f"tensor-parallel rank {rank}: {why}"))
        res.rank_events["connected"] = lambda rank, source: arrivals.on_peer_connected(source)
        res.rank_events["gone"] = lambda rank, source: arrivals.on_peer_gone(source)
    blobs = model.call("kv_engine", (c.transfer_engine, engine_config, c.role, res.loaded.config.num_kv_heads,
                                     c.max_write_bytes))
    res.rank_endpoints = tuple(EndpointInfo.from_bytes(b) for b in blobs)


class WorkerService(Protocol):
    """What `serve` needs from a role's service object."""

    def add_to_server(self, server: grpc.aio.Server) -> None: ...
    def load(self) -> pb.LoadStats: ...
    def drain(self, timeout_s: float) -> None: ...
    def close(self) -> None: ...


def worker_info(res: WorkerResources, address: str) -> pb.WorkerInfo:
    c = res.config
    return pb.WorkerInfo(
        worker_id=c.worker_id, role=pb.PREFILL if c.role == "prefill" else pb.DECODE,
        grpc_address=address, host_id=local_host_id(), protocol_version=PROTOCOL_VERSION,
        compat_hash=res.compat_hash, model_name=res.loaded.config.name, num_blocks=c.num_blocks,
        block_size=c.block_size, transfer_engine=c.transfer_engine, prefix_caching=c.prefix_caching,
        tensor_parallel_size=c.tensor_parallel_size)


class WorkerProcess:
    """What a worker process runs (one per process, driven by `serve`): the role's service on a
    gRPC server (`worker.rpcserver.AioServer`) + registration with the router. `start` registers;
    `stop` drains and shuts everything down."""

    def __init__(self, res: WorkerResources, service: WorkerService):
        self.res = res
        self.service = service
        c = res.config
        self.tls = TLSFiles(c.tls_cert, c.tls_key, c.tls_ca)
        self.server = AioServer(c.role, f"{c.listen_host}:{c.listen_port}", service.add_to_server,
                                c.secret, self.tls)
        port = self.server.start()
        self.address = f"{c.host_for_peers}:{port}"
        self.stopped = threading.Event()
        self._closed = False
        kv_events = None
        if c.prefix_caching:
            res.pool.allocator.track_events()
            kv_events = res.pool.allocator.take_events
        self.registration = RegistrationClient(c.router, worker_info(res, self.address), self.load,
                                               c.heartbeat_interval_s, on_refused=self._refused,
                                               secret=c.secret, tls=self.tls, kv_events=kv_events)

    def load(self) -> pb.LoadStats:
        """The service's load, unhealthy too when the gRPC server thread is gone."""
        load = self.service.load()
        if not self.server.alive and not load.unhealthy:
            load.unhealthy, load.unhealthy_reason = True, "gRPC server thread died"
        return load

    def _refused(self, reason: str) -> None:
        log.error("registration refused: %s", reason)
        self.stopped.set()

    def start(self) -> None:
        self.registration.start()
        log.info("%s worker %s serving on %s (weights %s, KV %s)", self.res.config.role,
                 self.res.config.worker_id, self.address, self.res.loaded.weights, self.res.cache.dtype)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Drain, leave the router, stop the server, release everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.service.drain(drain_timeout_s)
        self.registration.close(leave=True)
        self.server.stop(grace_s=2.0)
        self.service.close()
        self.res.close()
        self.stopped.set()


T = TypeVar("T")


def run_on_own_thread(name: str, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a thread of its own, named ``name``, that has exited when this returns;
    returns its result or raises what it raised.

    Why: a worker builds its model and pool with parallel torch operators, and each thread that
    runs one becomes the master of an OpenMP team that lives as long as the thread does. With
    the build's team alive on the main thread beside the compute loop's own, libgomp manages more
    threads than the process has CPUs and stops spinning at its barriers, which slowed every
    two-thread forward pass of the loop (measured: docs/PERFORMANCE.md, "One OpenMP team per
    worker"). Built on a thread that ends, the build's team ends with it, and
    the compute loop's team is the process's only one.
    """
    out: list = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:   # noqa: BLE001 - handed to the caller's thread
            err.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if err:
        raise err[0]
    return out[0]


STOP_POLL_S = 0.2
"""How often `serve`'s main thread looks for a stop signal (seconds)."""


def install_stop_signals() -> list[int]:
    """SIGTERM and SIGINT handlers that only append the signal's number to the returned list.

    A Python signal handler runs in the main thread between two of its bytecodes, possibly while
    that thread holds a lock: inside ``threading.Event.wait`` it holds the event's condition
    lock, and a handler calling ``Event.set`` there takes that lock again and blocks the process
    forever (a worker once ignored every later SIGTERM that way). Appending to a list takes no
    lock; the caller polls the list. Call from the main thread."""
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    return received


def serve(config: WorkerConfig, build: Callable[[WorkerConfig], WorkerProcess]) -> int:
    """Run a worker until SIGTERM/SIGINT; returns the process exit code: 0, 3 when the router
    refused the registration, 4 when the worker was lost (`WorkerResources.lose`)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {config.worker_id} %(levelname)s %(name)s: %(message)s")
    bound_native_memory(config.role)
    pin_to_own_cpus(config)
    process = run_on_own_thread("worker-build", build, config)
    stop = install_stop_signals()
    process.start()
    while not stop and not process.stopped.is_set() and not process.res.lost.is_set():
        time.sleep(STOP_POLL_S)
    refused = process.stopped.is_set() and not stop
    lost = process.res.lost.is_set()
    process.stop()
    return 4 if lost else 3 if refused else 0
