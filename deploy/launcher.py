"""Local launcher: router + N prefill + M decode workers as separate processes on this host.

Lifecycle of a `Cluster`:

1. ``start()``: pick free ports where asked (port 0), start the router
   (``python -m router``), then every worker (``python -m prefill|decode --router ...
   --listen 127.0.0.1:0 --worker-id prefill-0 ...``), each logging to ``<log_dir>/<name>.log``
   and, with ``cpu_affinity``, pinned to its CPU (``os.sched_setaffinity`` before exec).
2. ``wait_ready()`` (called by ``start``): until ``startup_timeout_s``, poll the router's
   ``/admin/workers`` until every expected worker is CONNECTED. A child that exits, or a worker
   not connected at the deadline, raises `LaunchError` naming it, with the tail of its log.
3. ``stop()``: SIGTERM the workers (they Leave the router and drain), wait up to ``grace_s``, then
   the router; anything still alive after its grace period is SIGKILLed. Idempotent; also run
   by ``with Cluster(...)`` on exit.

Children are started in their own sessions (a terminal's Ctrl-C reaches the launcher only, which
then stops them in order) and, on Linux, get SIGTERM if the launcher dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from router.serving import SERVING_MODES, check_mode
from worker.cpu_board import CpuBoard

# worker.config.TRANSFER_ENGINES, named here because deploy imports no torch (a test keeps them equal).
TRANSFER_ENGINES = ("auto", "tcp", "shm", "verbs", "cuda_ipc")


# The --weights choices (engine.config.WEIGHT_CHOICES, named here because deploy imports no torch).
WEIGHT_MODES = ("auto", "fp32", "bf16", "native")


class LaunchError(RuntimeError):
    """A child did not come up; the message names it and carries its log tail."""


@dataclass(frozen=True)
class LauncherConfig:
    """What to start.

    Fields:
        num_prefill / num_decode: worker counts (>= 1 each; 0 prefill workers is allowed when
            ``serving_mode`` is not "disaggregated").
        http_host / http_port: the router's OpenAI API (port 0: a free port).
        registry_port: the router's Registry gRPC port on 127.0.0.1 (0: a free port).
        transfer_engine: the workers' kvtransfer engine ("auto": shm between same-host peers).
        model: GGUF file or HF directory (None: the default SmolLM2-135M-Instruct).
        weights: every worker's ``--weights`` ("auto": the checkpoint's own format where the
            machine runs it natively, `engine.loader.resolve_weights`; "fp32", the reference;
            "bf16"; "native").
        num_blocks: KV pool blocks per worker (None: the worker default).
        threads: torch threads per worker.
        log_dir: where ``<name>.log`` files go (None: a new temporary directory).
        startup_timeout_s: how long every worker may take to become CONNECTED (seconds; a
            first start on a new machine builds and times its kernels before it registers).
        grace_s: how long a child may take to exit after SIGTERM before SIGKILL.
        router_args / worker_args: extra flags passed through to every router / worker.
        serving_mode / colocated_threshold_tokens: the router's (`router.serving`):
            "disaggregated", "colocated" (decode workers run whole requests) or "auto"
            (prompts under the threshold colocated).
        cpu_affinity: CPUs to pin workers to, ``threads`` each (consecutive in this order), in
            start order (prefill-0, prefill-1, ..., decode-0, ...), cycling when there are more
            workers than CPUs; empty: no pinning. The router is never pinned. A tensor-parallel
            worker's ranks share its CPUs.
        device: every worker's ``--device`` ("cpu" or "cuda[:n]": weights and KV pool there; two
            GPU pools on one host move KV with cuda_ipc, others staged or over verbs).
        prefill_tp / decode_tp: the tensor parallel size of each prefill / decode worker in order
            (``--tensor-parallel-size``, `engine.tp`), the last repeating for the rest; any sizes
            the model's KV heads split over pair (`worker.tp_rank`).
        lend_idle_cpus: with ``cpu_affinity`` giving every worker CPUs of its own (CPU workers
            at TP 1), a worker's long passes (prompt chunks) also run on the other workers' CPUs
            while those wait for work (`worker.cpu_board`; the board is ``<log_dir>/cpu-board``).
    """

    num_prefill: int = 1
    num_decode: int = 1
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    registry_port: int = 50050
    transfer_engine: str = "auto"
    model: str | None = None
    weights: str = "auto"
    num_blocks: int | None = None
    threads: int = 1
    log_dir: str | None = None
    startup_timeout_s: float = 600.0
    grace_s: float = 10.0
    router_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    serving_mode: str = "disaggregated"
    colocated_threshold_tokens: int = 0
    cpu_affinity: tuple[int, ...] = ()
    decode_tp: tuple[int, ...] = (1,)
    prefill_tp: tuple[int, ...] = (1,)
    device: str = "cpu"
    lend_idle_cpus: bool = True

    def __post_init__(self) -> None:
        check_mode(self.serving_mode, self.colocated_threshold_tokens)
        for name in ("prefill_tp", "decode_tp"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) < 1:
                raise ValueError(f"{name} must list sizes >= 1, got {sizes}")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("at least one decode worker is needed")
        if self.num_prefill < 1 and self.serving_mode == "disaggregated":
            raise ValueError("disaggregated serving needs at least one prefill worker "
                             f"(or serving mode {' / '.join(SERVING_MODES[1:])})")
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        bad = [c for c in self.cpu_affinity if c not in usable]
        if bad:
            raise ValueError(f"cpu_affinity: CPUs {bad} are not available here ({sorted(usable)})")
        for name in ("http_port", "registry_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.transfer_engine not in TRANSFER_ENGINES:
            raise ValueError(f"transfer_engine must be one of {TRANSFER_ENGINES}, got {self.transfer_engine!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.startup_timeout_s <= 0 or self.grace_s <= 0:
            raise ValueError("startup_timeout_s and grace_s must be > 0")


@dataclass
class Child:
    """One started process: ``name`` (router or the worker id), its command and log file."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, for a process started next to bind (racy by nature).

    Picked at random below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), so
    no port-0 listener or outgoing connection of another process can take it before that
    process binds: a kernel-chosen port could (a CI run lost a worker's gRPC port to one,
    "Failed to bind"). Only another explicit pick can still collide. Falls back to the
    kernel's choice when no port below the range is free.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768   # Linux's default
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(10000, max(ephemeral_low, 10001))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


LENDING_SPIN_COUNT = 10_000
"""libgomp's spins at a barrier before it sleeps (``GOMP_SPINCOUNT``; libgomp's default is
300,000) for a worker that borrows CPUs: within a pass its threads meet again quickly, and after
the pass a thread on a borrowed CPU stops spinning beside that CPU's owner 30x sooner (measured:
docs/PERFORMANCE.md, "Lending idle CPUs")."""


THREAD_BINDING_VARS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
"""Environment variables by which a user binds OpenMP threads himself; with any set, `Cluster`
leaves the binding to them."""


def thread_places(own: tuple[int, ...], lent: set[int]) -> str:
    """libgomp's ``OMP_PLACES`` for a pinned worker: one place per CPU, its own CPUs first (in
    order), then those it may borrow. With ``OMP_PROC_BIND=close`` libgomp binds the master
    thread of each OpenMP team to the first place and its i-th thread to place i (OpenMP 5.2,
    sections 6.4-6.5 "OMP_PLACES", "OMP_PROC_BIND"; vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` binds
    one thread per core the same way), so a pass's threads never share a CPU while another is
    free, and a pass that borrows N CPUs runs its extra threads on exactly those.
    ``thread_places((1,), {0})`` is ``"{1},{0}"``."""
    return ",".join(f"{{{c}}}" for c in [*own, *sorted(set(lent) - set(own))])


def _pinned_child(cpus: set[int]):
    def setup() -> None:  # runs in the child between fork and exec
        _die_with_parent()
        os.sched_setaffinity(0, cpus)
    return setup


class Cluster:
    """A router and its workers as child processes. See the module docstring for the lifecycle."""

    def __init__(self, config: LauncherConfig):
        self.config = config
        c = config
        self.http_port = c.http_port or free_port(c.http_host)
        self.registry_port = c.registry_port or free_port()
        self.log_dir = Path(c.log_dir or tempfile.mkdtemp(prefix="pdserve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.router = Child("router", self._router_argv(), self.log_dir / "router.log")
        names = [f"prefill-{i}" for i in range(c.num_prefill)] + [f"decode-{i}" for i in range(c.num_decode)]
        self.workers = [Child(n, self._worker_argv(n), self.log_dir / f"{n}.log") for n in names]
        self.cpus: dict[str, tuple[int, ...]] = {   # each worker's CPUs (`LauncherConfig.cpu_affinity`)
            n: tuple(sorted({c.cpu_affinity[(i * c.threads + j) % len(c.cpu_affinity)] for j in range(c.threads)}))
            for i, n in enumerate(names)} if c.cpu_affinity else {}
        self.lent = self._lending()
        self.passive = self.oversubscribed()
        self.board_path = self.log_dir / "cpu-board"
        for w in self.workers:
            if w.name in self.lent:
                w.argv += ["--cpu-board", str(self.board_path),
                           "--borrow-cpus", ",".join(map(str, sorted(self.lent[w.name])))]
        self._stopped = False

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (``.../v1`` is the client's base_url)."""
        return f"http://{self.config.http_host}:{self.http_port}"

    @property
    def children(self) -> list[Child]:
        return [self.router, *self.workers]

    def _router_argv(self) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "router", "--http-host", c.http_host,
                "--http-port", str(self.http_port),
                "--registry-address", f"127.0.0.1:{self.registry_port}",
                "--serving-mode", c.serving_mode,
                "--colocated-threshold-tokens", str(c.colocated_threshold_tokens)]
        if c.model:
            argv += ["--model", c.model]
        return argv + list(c.router_args)

    def _lending(self) -> dict[str, set[int]]:
        """The CPUs each worker may borrow (`LauncherConfig.lend_idle_cpus`): every other
        worker's, when each pinned CPU worker at TP 1 has CPUs of its own; else none."""
        c = self.config
        pinned = [set(cpus) for cpus in self.cpus.values()]
        every = set().union(*pinned)
        if (not c.lend_idle_cpus or c.device != "cpu" or len(pinned) < 2 or sum(map(len, pinned)) > len(every)
                or any(self._tp(w.name) > 1 for w in self.workers)):
            return {}
        return {n: every - set(cpus) for n, cpus in self.cpus.items()}

    def _tp(self, name: str) -> int:
        sizes = self.config.decode_tp if name.startswith("decode") else self.config.prefill_tp
        return sizes[min(int(name.split("-")[1]), len(sizes) - 1)]

    def oversubscribed(self) -> set[str]:
        """The workers whose torch threads, with those of every worker sharing a CPU with them,
        outnumber the CPUs they share (each worker's threads times its TP ranks; a pinned worker
        on its CPU, an unpinned one on this process's CPUs). `_spawn` gives them libgomp's passive
        wait (``OMP_WAIT_POLICY=PASSIVE``): libgomp stops spinning at its barriers when it
        manages more threads than the process has CPUs, but cannot see another process's
        threads, and two processes spinning on the same cores starve each other (measured:
        docs/PERFORMANCE.md, "One OpenMP team per worker")."""
        everywhere = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        cpus = {w.name: set(self.cpus[w.name]) if w.name in self.cpus else everywhere for w in self.workers}
        threads = {w.name: self.config.threads * self._tp(w.name) for w in self.workers}
        out = set()
        for name, mine in cpus.items():
            sharing = [v for v in cpus if cpus[v] & mine]
            shared = set().union(*(cpus[v] for v in sharing))
            if sum(threads[v] for v in sharing) > len(shared) and threads[name] > 1:
                out.add(name)
        return out

    def binds_threads(self, name: str) -> bool:
        """Whether `_spawn` binds worker ``name``'s OpenMP threads one per CPU (`thread_places`):
        a pinned CPU worker at TP 1 whose threads do not share its CPUs with another worker's
        (not `oversubscribed`). Tensor-parallel ranks are left alone: their follower processes
        would inherit the binding of rank 0's first CPU."""
        return (name in self.cpus and self.config.device == "cpu" and self._tp(name) == 1
                and name not in self.passive)

    def _worker_argv(self, name: str) -> list[str]:
        c = self.config
        role = name.split("-")[0]
        argv = [sys.executable, "-m", role, "--router", f"127.0.0.1:{self.registry_port}",
                "--listen", "127.0.0.1:0", "--worker-id", name,
                "--transfer-engine", c.transfer_engine, "--threads", str(c.threads), "--weights", c.weights]
        if c.num_blocks is not None:
            argv += ["--num-blocks", str(c.num_blocks)]
        if c.device != "cpu":
            argv += ["--device", c.device]
        if c.model:
            argv += ["--model", c.model]
        tp = self._tp(name)
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        return argv + list(c.worker_args)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Start everything and wait until every worker is connected. Raises `LaunchError`
        (after stopping whatever was started)."""
        try:
            if self.lent:   # every CPU busy until its owner says it waits
                CpuBoard.create(self.board_path, max(map(max, self.cpus.values())) + 1).close()
            self._spawn(self.router)
            for w in self.workers:
                self._spawn(w)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, child: Child) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
            if child.name in self.passive:
                env["OMP_WAIT_POLICY"] = "PASSIVE"
            elif child.name in self.lent:   # a borrowed CPU's thread stops spinning soon after its pass
                env["GOMP_SPINCOUNT"] = str(LENDING_SPIN_COUNT)
        cpus = self.cpus.get(child.name)
        if self.binds_threads(child.name) and not set(THREAD_BINDING_VARS) & set(os.environ):
            env["OMP_PLACES"] = thread_places(cpus, self.lent.get(child.name, set()))
            env["OMP_PROC_BIND"] = "close"
        with open(child.log_path, "ab") as log:
            child.popen = subprocess.Popen(
                child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
                preexec_fn=_die_with_parent if cpus is None else _pinned_child(set(cpus) | self.lent.get(child.name, set())))

    def wait_ready(self) -> None:
        """Block until every worker is CONNECTED at the router. Raises `LaunchError`."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        states: dict[str, str] = {}
        with httpx.Client(timeout=2.0) as client:
            while True:
                self._check_alive()
                try:
                    members = client.get(f"{self.url}/admin/workers").json()
                    states = {m["id"]: m["state"] for m in members}
                except (httpx.HTTPError, ValueError):
                    pass
                if all(states.get(w.name) == "CONNECTED" for w in self.workers):
                    return
                if time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        late = [w for w in self.workers if states.get(w.name) != "CONNECTED"]
        details = "\n".join(f"--- {w.name} ({states.get(w.name, 'not registered')}), "
                            f"log {w.log_path}:\n{w.log_tail()}" for w in late)
        raise LaunchError(f"not connected after {self.config.startup_timeout_s:g}s: "
                          f"{', '.join(w.name for w in late)}\n{details}")

    def _check_alive(self) -> None:
        for child in self.children:
            if child.popen is not None and child.popen.poll() is not None:
                raise LaunchError(f"{child.name} exited with code {child.popen.returncode}; "
                                  f"log {child.log_path}:\n{child.log_tail()}")

    def dead_children(self) -> list[Child]:
        """Children that exited while they should be running."""
        return [c for c in self.children if c.popen is not None and c.popen.poll() is not None]

    def stop(self) -> None:
        """SIGTERM workers, then the router; SIGKILL what outlives ``grace_s``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._terminate(self.workers)
        self._terminate([self.router])

    def _terminate(self, children: list[Child]) -> None:
        running = [c for c in children if c.alive()]
        for c in running:
            c.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_s
        for c in running:
            try:
                c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
