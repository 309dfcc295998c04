"""Lending idle CPUs between the workers of one host.

Pinned one per CPU (``pdserve up --cpu-affinity``), a prefill and a decode worker each leave the
other's CPU idle whenever one of them has nothing to do: at one request in flight the decode
worker idles while the prompt is computed, and the prefill worker while the answer is decoded.
A long pass (a prompt chunk) could run on both CPUs then (a second torch thread; measured in
docs/PERFORMANCE.md, "Lending idle CPUs"), but only then: a pass on two threads beside a busy neighbour is slower than
on one (every operator ends at a barrier of its threads; docs/PERFORMANCE.md, "Threads per pass").

The `CpuBoard` says which owned CPUs are busy. It is a small file mapped shared by every worker
of the host (the launcher creates it), one byte per CPU: 1 while the CPU's owner has work, 0 while
it waits for work. A CPU nobody marked stays busy. Owners write only their own CPUs' bytes;
borrowers only read, so the board needs no lock (a stale read costs at most one layer, below).

`CpuLending` is one worker's side of it:

- as owner, `CpuLending.busy` marks its own CPUs when its loop finds work or waits for it;
- as borrower, for a pass of at least ``parallel_min_tokens`` tokens (`engine.runner.ModelRunner`)
  `CpuLending.take` takes the lent CPUs that are idle now: the pass runs one more torch thread
  per CPU taken. The launcher binds a worker's OpenMP threads one per CPU, its own first and the
  lent ones after (`deploy.launcher.thread_places`, ``OMP_PROC_BIND=close``), so the extra
  threads run on the lent CPUs and the calling thread stays on its own; a worker started without
  that binding widens the calling thread's affinity to the lent CPUs for the pass instead (the
  extra threads, created or woken by it, may then run there, but the scheduler may also keep two
  of the pass's threads on one CPU: docs/PERFORMANCE.md, "Borrowed passes with bound threads"), and
  `CpuLending.reclaimed` tells the runner at each layer whether an owner wants its CPU back,
  when the pass drops to its own threads for the next layers (taking the CPUs again at a later
  layer where they are idle again). `CpuLending.give_back` ends the loan (narrowing a widened affinity). A worker's other threads stay on its own CPUs.

The worker's process is started with its own CPUs and the lent ones allowed (libgomp counts the
CPUs it may use when torch loads, and spins at its barriers only while its threads fit them:
docs/PERFORMANCE.md, "One OpenMP team per worker"), and `CpuLending.pin_to_own` then keeps the
main thread, and every thread it starts, on the worker's own CPUs. Linux only
(``os.sched_setaffinity`` of the calling thread).
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
from collections.abc import Iterable
from pathlib import Path

BUSY, IDLE = 1, 0


class CpuBoard:
    """Busy flags of the host's CPUs, ``num_cpus`` bytes of the file at ``path`` mapped shared.

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: the file is smaller than ``num_cpus`` bytes, or a CPU index is outside it.
    """

    def __init__(self, path: str | Path, num_cpus: int | None = None):
        self.path = Path(path)
        with open(self.path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 1 or (num_cpus is not None and size < num_cpus):
                raise ValueError(f"CPU board {self.path} holds {size} CPUs, {num_cpus} needed")
            self._map = mmap.mmap(f.fileno(), size)
        self.num_cpus = size

    @classmethod
    def create(cls, path: str | Path, num_cpus: int) -> "CpuBoard":
        """A new board of ``num_cpus`` CPUs, every one busy (owners mark theirs idle)."""
        if num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
        Path(path).write_bytes(bytes([BUSY]) * num_cpus)
        return cls(path, num_cpus)

    def _check(self, cpu: int) -> int:
        if not 0 <= cpu < self.num_cpus:
            raise ValueError(f"CPU {cpu} is not on the board ({self.num_cpus} CPUs)")
        return cpu

    def mark(self, cpus: Iterable[int], busy: bool) -> None:
        """Set ``cpus`` busy or idle."""
        for c in cpus:
            self._map[self._check(c)] = BUSY if busy else IDLE

    def idle(self, cpus: Iterable[int]) -> list[int]:
        """Those of ``cpus`` whose owner waits for work now."""
        return [c for c in cpus if self._map[self._check(c)] == IDLE]

    def close(self) -> None:
        self._map.close()


def omp_binds_threads(environ=os.environ) -> bool:
    """Whether libgomp binds this process's OpenMP threads to places (``OMP_PLACES`` set and
    ``OMP_PROC_BIND`` neither unset nor ``false``; OpenMP 5.2, section 6.5)."""
    bind = environ.get("OMP_PROC_BIND", "").strip().lower()
    return bool(environ.get("OMP_PLACES", "").strip()) and bind not in ("", "false")


def process_cpus(environ=os.environ) -> set[int]:
    """The CPUs this process was started on. libgomp binds the initial thread to the first place
    of ``OMP_PLACES`` when it loads (with torch), so the calling thread's affinity is the answer
    only without binding; with it, the places written one CPU each (``{1},{0}``, as
    `deploy.launcher.thread_places` writes them) are. Other ``OMP_PLACES`` forms: the calling
    thread's affinity."""
    places = environ.get("OMP_PLACES", "").strip()
    if omp_binds_threads(environ) and re.fullmatch(r"\{\d+\}(,\{\d+\})*", places):
        return {int(c) for c in re.findall(r"\d+", places)}
    return set(os.sched_getaffinity(0))


class CpuLending:
    """One worker's side of the board (module doc): ``own`` CPUs it marks, ``lent`` CPUs it may
    borrow. Raises ValueError when the two overlap or ``own`` is empty."""

    def __init__(self, board: CpuBoard, own: Iterable[int], lent: Iterable[int], threads_bound: bool = False):
        """``threads_bound``: libgomp binds the worker's OpenMP threads one per CPU, own CPUs
        first (`omp_binds_threads`; the launcher's `deploy.launcher.thread_places`): a loan then
        only changes the pass's thread count, its extra threads already on the lent CPUs, and the
        calling thread stays on its own (widened instead, it and a thread on a lent CPU could
        both be scheduled on one CPU for a whole pass)."""
        self.board = board
        self.threads_bound = threads_bound
        self.own = frozenset(own)
        self.lent = tuple(sorted(set(lent)))
        if not self.own or self.own & set(self.lent):
            raise ValueError(f"own CPUs {sorted(self.own)} must be non-empty and apart from lent {list(self.lent)}")
        board.idle(self.own | set(self.lent))   # ValueError for a CPU outside the board
        self._taken: list[int] = []
        self._busy: bool | None = None

    def pin_to_own(self) -> None:
        """Keep the calling thread, and the threads it starts from now on, on the own CPUs."""
        os.sched_setaffinity(0, self.own)

    def busy(self, flag: bool) -> None:
        """Mark the own CPUs busy (the loop has work) or idle (it waits for work)."""
        if flag != self._busy:
            self.board.mark(self.own, flag)
            self._busy = flag

    def take(self) -> int:
        """Take the lent CPUs idle now for one pass; returns how many (0: none, nothing changed).
        With ``threads_bound`` only the idle ones before the first busy one in ``lent`` order:
        libgomp puts a team's i-th extra thread on the i-th lent place whichever CPU is idle."""
        idle = self.board.idle(self.lent)
        if self.threads_bound:
            idle = list(itertools.takewhile(lambda c: c in idle, self.lent))
        self._taken = idle
        if self._taken and not self.threads_bound:
            os.sched_setaffinity(0, self.own | set(self._taken))
        return len(self._taken)

    def owners_busy(self) -> bool:
        """Whether the owner of any lent CPU has work now (this worker could not borrow it)."""
        return len(self.board.idle(self.lent)) < len(self.lent)

    def reclaimed(self) -> bool:
        """Whether the owner of a CPU taken has work again."""
        return bool(self._taken) and len(self.board.idle(self._taken)) < len(self._taken)

    def give_back(self) -> None:
        """End the pass's loan: the calling thread back on the own CPUs."""
        if self._taken:
            self._taken = []
            if not self.threads_bound:
                os.sched_setaffinity(0, self.own)

    def close(self) -> None:
        """Mark the own CPUs busy (a worker gone lends nothing) and unmap the board."""
        self.busy(True)
        self.board.close()


def lending_of(config) -> CpuLending | None:
    """The worker's `CpuLending` when ``config`` (a `worker.config.WorkerConfig`) names a CPU
    board: its own CPUs are its affinity (the calling thread's) less the lent ones. Raises
    ValueError (none of its own left), OSError / ValueError from the board."""
    if not config.cpu_board:
        return None
    lent = set(config.lent_cpus())
    own = process_cpus() - lent
    if not own:
        raise ValueError(f"borrow_cpus {sorted(lent)} leave this worker no CPU of its own")
    return CpuLending(CpuBoard(config.cpu_board), own, lent, threads_bound=omp_binds_threads())


def pin_to_own_cpus(config) -> None:
    """With CPU lending (``config``: a `worker.config.WorkerConfig`), keep the main thread and every
    thread started after this on the worker's own CPUs (`process_cpus` less the lent ones); the
    process was allowed the lent ones too, so that libgomp counts them (module docstring)."""
    if config.cpu_board:
        own = process_cpus() - set(config.lent_cpus())
        if own:
            os.sched_setaffinity(0, own)
