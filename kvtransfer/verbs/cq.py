"""The verbs engine's completion loop: the thread ``kv-verbs-cq`` owns the CQ, the SRQ refills,
the send budget and every QP's life after it is connected.

What it does, each round: poll the CQ dry and dispatch each completion on its ``wr_id``
(:class:`~kvtransfer.verbs.support.WrKind`; a failed completion's opcode is undefined); refill the
SRQ in batches; post queued writes while the send budget allows; run queued commands (tear a QP
down); expire drain deadlines; then wait. Waiting is ``select()`` on the completion channel's fd,
the async-event fd and a wake pipe (``cq_mode="event"``), or a 0.1-10 ms backoff
(``cq_mode="poll"``, or no channel fd found) - never a blocking verbs call, which pyverbs makes
holding the GIL, and never a busy loop.

Budget: one CQ serves the SRQ and every send queue. At most ``VerbsConfig.send_budget`` sends
are outstanding (every send is signaled, so each produces exactly one completion, a flushed one
included); receives are bounded by ``srq_depth``; drain markers by their own 64. Together they
fit in ``cq_depth``: the CQ cannot overrun. Writes beyond the budget, or beyond a QP's send
queue, wait in their peer's backlog and are posted as completions return credits.

Errors: an error completion (other than a flush) on a writer's QP fails that write's handle with
a typed error (``RemoteAccessError`` for REM_ACCESS_ERR, ``PeerLostError`` otherwise) and calls
``on_broken(owner, error)`` once; the engine tears the peer's QPs down and reconnects. Flushed
writes fail their handles with ``PeerLostError``. Async events (QP fatal, access errors) make
the loop look for QPs in ERR and treat them the same way. An exception in one round is logged
and counted; the loop goes on.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.config import VerbsConfig
from kvtransfer.connection import Shared, ThreadGroup
from kvtransfer.errors import KVTransferError, PeerLostError, RemoteAccessError
from kvtransfer.immediate import from_network_u32
from kvtransfer.verbs.device import Device, async_event_name
from kvtransfer.verbs.qp import QpState, RcQp, destroy, post_chain, post_drain_marker, to_error
from kvtransfer.verbs.support import (IBV_QPS_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_SUCCESS, IBV_WC_WR_FLUSH_ERR,
                                      QP_STATE, WC_STATUS_NAMES, Credits, WriteWithImm, WrKind, make_wr_id,
                                      split_wr_id)

log = logging.getLogger(__name__)
_POLL_BATCH = 64
_MARKERS = 64
_IDLE_WAKE_S = 1.0
_CHAIN = 64   # WRs per post_send chain (one doorbell each)


@dataclass(slots=True)
class QueuedWrite:
    """A write waiting for a send slot: its fields (``wr_id`` assigned at post) and its handle."""

    write: WriteWithImm
    handle: int


class CompletionLoop:
    """See the module docstring. ``on_broken(owner, error)`` runs on the loop's thread."""

    def __init__(self, device: Device, shared: Shared, config: VerbsConfig, threads: ThreadGroup,
                 on_broken: Callable[[str, KVTransferError], None], drain_timeout_s: float) -> None:
        self._dev, self._s, self._cfg = device, shared, config
        self._on_broken = on_broken
        self._drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)   # outstanding / backlog / QP states moved
        self._qps: dict[int, RcQp] = {}                  # qp_num -> QP not yet DEAD
        self._sources: dict[int, str] = {}               # qp_num -> inbound writer (kept after DEAD)
        self._owned: dict[str, list[RcQp]] = collections.defaultdict(list)   # owner -> its live QPs
        self._backlog: dict[str, collections.deque[QueuedWrite]] = collections.defaultdict(collections.deque)
        self._rr = 0
        self._credits = Credits(config.send_budget)
        self._markers = Credits(_MARKERS)
        self._marker_qp: dict[int, RcQp] = {}            # drain marker wr_id -> its QP
        self._broken: set[str] = set()                   # owners reported to on_broken, not yet reset
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wr_serial = 0
        self._recv_consumed = 0
        self._refill_batch = max(1, config.srq_depth // 8)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._dead_waiters: list[tuple[str, Callable[[], None]]] = []
        self._idle_rounds = 0
        self._stop = threading.Event()
        self.errors = 0
        self._thread = threads.start("kv-verbs-cq", self._run)

    # -- called from any thread ------------------------------------------------------------------
    def add(self, rc: RcQp, inbound_source: str | None = None) -> None:
        """Track a connected QP (now READY)."""
        with self._lock:
            rc.move(QpState.READY)
            self._qps[rc.qp_num] = rc
            self._owned[rc.owner].append(rc)
            if inbound_source is not None:
                self._sources[rc.qp_num] = inbound_source
            self._broken.discard(rc.owner)
            self._pump(rc.owner)
            self.changed.notify_all()
        self.wake()

    def submit(self, owner: str, writes: list[QueuedWrite]) -> None:
        """Queue ``writes`` for ``owner``'s QPs and post what the budget allows now."""
        with self._lock:
            self._backlog[owner].extend(writes)
            self._pump(owner)

    def pending(self, owner: str) -> int:
        """Writes of ``owner`` queued or outstanding."""
        with self._lock:
            return len(self._backlog.get(owner, ())) + sum(len(q.outstanding) for q in self._owned.get(owner, ()))

    def wait_idle(self, owner: str, timeout_s: float) -> bool:
        """Block until ``owner`` has nothing queued or outstanding, or ``timeout_s`` passes."""
        with self._lock:
            return self.changed.wait_for(lambda: not self._backlog.get(owner) and not any(
                q.outstanding for q in self._owned.get(owner, ())), timeout_s)

    def live_qps(self, owner: str) -> list[RcQp]:
        with self._lock:
            return [q for q in self._owned.get(owner, ()) if q.state != QpState.DEAD]

    def qp_states(self) -> dict[int, str]:
        """qp_num -> state name of every tracked QP (for tests and the doctor)."""
        with self._lock:
            return {n: q.state.name for n, q in self._qps.items()}

    def teardown(self, owner: str, error: KVTransferError, then: Callable[[], None] | None = None,
                 keep_backlog: bool = False) -> threading.Event:
        """Tear down every QP of ``owner`` on the loop's thread: move to ERR, let outstanding
        writes complete (flushed; their handles fail unless already failed), destroy, drain the
        CQ of what the QPs left there, fail the owner's queued writes with ``error`` (or keep
        them for the QPs of a reconnect: ``keep_backlog``), then run ``then``. Returns an event
        set when done."""
        done = threading.Event()

        def command() -> None:
            with self._lock:
                qps = [q for q in self._owned.get(owner, ()) if q.state in (QpState.READY, QpState.CONNECTING)]
                for rc in qps:
                    self._start_drain(rc)
                waiting = [q for q in self._owned.get(owner, ()) if q.state == QpState.DRAINING]
                backlog = collections.deque() if keep_backlog else self._backlog.pop(owner, collections.deque())
            self._s.tracker.parts_done([(w.handle, error) for w in backlog])

            def finished() -> None:
                self._poll_all()   # what the destroyed QPs left in the CQ is dispatched before `then`
                try:
                    if then is not None:
                        then()
                finally:
                    done.set()

            if waiting:
                self._when_dead(owner, finished)
            else:
                finished()

        with self._lock:
            self._commands.append(command)
        self.wake()
        return done

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass   # the pipe is full: the loop is awake anyway

    def stop(self) -> None:
        """Ask the loop to end after its current round (the engine joins the thread)."""
        self._stop.set()
        self.wake()

    def close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def leftover_qps(self) -> list[RcQp]:
        """QPs not DEAD (after the thread stopped; the engine destroys them)."""
        with self._lock:
            return list(self._qps.values())

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._poll_all()
                self._run_commands()
                self._expire_drains()
                if not busy:
                    self._wait()
            except Exception:   # noqa: BLE001 - the loop must survive; the error is counted
                self.errors += 1
                log.exception("verbs completion loop: error in one round (carrying on)")
                self._stop.wait(0.05)

    def _wait(self) -> None:
        fds = [self._wake_r] + ([self._dev.async_fd] if self._dev.async_fd is not None else [])
        event_mode = self._cfg.cq_mode == "event" and self._dev.cq_fd is not None
        if event_mode:
            self._dev.request_notify()
            if self._poll_all():   # completions that raced with arming
                return
            fds.append(self._dev.cq_fd)
            timeout = self._next_deadline(_IDLE_WAKE_S)
        else:
            self._idle_rounds += 1
            timeout = self._next_deadline(min(0.01, 0.0001 * (2 ** min(self._idle_rounds, 7))))
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if event_mode and self._dev.cq_fd in ready:
            self._dev.consume_cq_event()
        if self._dev.async_fd is not None and self._dev.async_fd in ready:
            self._read_async_events()

    def _next_deadline(self, default: float) -> float:
        with self._lock:
            deadlines = [q.drain_deadline for q in self._qps.values() if q.state == QpState.DRAINING]
        if not deadlines:
            return default
        return max(0.0, min(default, min(deadlines) - time.monotonic()))

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            command()

    # -- completions -----------------------------------------------------------------------------
    def _poll_all(self) -> bool:
        """Poll the CQ dry, dispatching; True when anything was there."""
        any_work = False
        while True:
            wcs = self._dev.poll(_POLL_BATCH)
            if not wcs:
                break
            any_work = True
            self._idle_rounds = 0
            self._dispatch(wcs)
        if self._recv_consumed >= self._refill_batch:
            consumed, self._recv_consumed = self._recv_consumed, 0
            self._dev.refill(consumed)
        return any_work

    def _dispatch(self, wcs: list) -> None:
        arrivals: list[tuple[int, str]] = []
        parts: list[tuple[int, KVTransferError | None]] = []
        received = nbytes = 0
        broken: list[tuple[str, KVTransferError]] = []
        with self._lock:
            for wc in wcs:
                kind, _ = split_wr_id(wc.wr_id)
                if kind == WrKind.RECV:
                    self._recv_consumed += 1
                    if wc.status == IBV_WC_SUCCESS:
                        arrivals.append((from_network_u32(wc.imm_data), self._sources.get(wc.qp_num, "")))
                        received += 1
                        nbytes += wc.byte_len
                    else:
                        log.warning("receive completion with status %s", WC_STATUS_NAMES.get(wc.status, wc.status))
                elif kind == WrKind.WRITE:
                    self._write_done(wc, parts, broken)
                else:
                    self._marker_done(wc.wr_id)
            touched = {owner for owner, queue in self._backlog.items() if queue}
            for owner in touched:
                self._pump(owner)
            self.changed.notify_all()
        if parts:
            self._s.tracker.parts_done(parts)
        if received:
            self._s.counters.add(writes_received=received, bytes_received=nbytes)
            self._deliver(arrivals)
        for owner, error in broken:
            self._on_broken(owner, error)

    def _write_done(self, wc, parts: list, broken: list) -> None:
        rc = self._qps.get(wc.qp_num)
        handle = rc.outstanding.pop(wc.wr_id, None) if rc is not None else None
        if handle is None:
            return   # released by an expired drain already
        self._credits.give(1)
        if wc.status == IBV_WC_SUCCESS:
            parts.append((handle, None))
            return
        name = WC_STATUS_NAMES.get(wc.status, str(wc.status))
        if wc.status == IBV_WC_WR_FLUSH_ERR:
            parts.append((handle, PeerLostError(f"write flushed: the connection to {rc.owner} was reset")))
            return
        if wc.status == IBV_WC_REM_ACCESS_ERR:
            error: KVTransferError = RemoteAccessError(
                f"remote access error (wrong key or outside the peer's region; vendor error {wc.vendor_err})")
        else:
            error = PeerLostError(f"write to {rc.owner} failed: {name} (vendor error {wc.vendor_err})")
        parts.append((handle, error))
        if rc.owner not in self._broken:
            self._broken.add(rc.owner)
            broken.append((rc.owner, error))

    def _deliver(self, arrivals: list[tuple[int, str]]) -> None:
        on_immediate = self._s.arrivals.on_immediate
        run_imm, run_src, count = arrivals[0][0], arrivals[0][1], 0
        for imm, src in arrivals:
            if (imm, src) != (run_imm, run_src):
                on_immediate(run_imm, run_src, count)
                run_imm, run_src, count = imm, src, 0
            count += 1
        on_immediate(run_imm, run_src, count)

    # -- posting (called with the lock held) -----------------------------------------------------
    def _pump(self, owner: str) -> None:
        if owner in self._broken:
            return   # its QPs failed: what is queued waits for the reconnect (or fails with it)
        queue = self._backlog.get(owner)
        qps = [q for q in self._owned.get(owner, ()) if q.state == QpState.READY]
        if not queue or not qps:
            return
        while queue:
            rc = qps[self._rr % len(qps)]
            self._rr += 1
            room = self._cfg.send_queue_depth - len(rc.outstanding)
            n = self._credits.take(min(room, len(queue), _CHAIN))
            if n == 0:
                if all(self._cfg.send_queue_depth <= len(q.outstanding) for q in qps) or self._credits.free == 0:
                    return
                continue
            batch = [queue.popleft() for _ in range(n)]
            writes = []
            for item in batch:
                self._wr_serial += 1
                wr_id = make_wr_id(WrKind.WRITE, self._wr_serial)
                w = item.write
                writes.append(WriteWithImm(wr_id, w.local_addr, w.length, w.lkey, w.remote_addr, w.rkey,
                                           w.imm_data, w.opcode, w.send_flags))
                rc.outstanding[wr_id] = item.handle
            try:
                post_chain(rc, writes)
            except Exception as exc:   # noqa: BLE001 - a failed post is a QP error; draining sorts it out
                log.warning("post_send on QP %d failed (%s): tearing the connection down", rc.qp_num, exc)
                if rc.owner not in self._broken:
                    self._broken.add(rc.owner)
                    error = PeerLostError(f"posting to {owner} failed: {exc}")
                    self._commands.append(lambda o=owner, e=error: self._on_broken(o, e))
                return

    # -- teardown (loop thread) ------------------------------------------------------------------
    def _start_drain(self, rc: RcQp) -> None:
        """Lock held. ERR, then a marker after the outstanding WRs (or destroy at once)."""
        to_error(rc)
        rc.move(QpState.DRAINING)
        if not rc.outstanding:
            self._kill(rc)
            return
        rc.drain_deadline = time.monotonic() + self._drain_timeout_s
        if self._markers.take(1) == 1:
            try:
                self._marker_qp[post_drain_marker(rc, self._dev.scratch_addr, self._dev.scratch_lkey)] = rc
            except Exception as exc:   # noqa: BLE001 - the deadline releases it instead
                self._markers.give(1)
                log.info("drain marker refused on QP %d (%s); waiting for flushes until the deadline",
                         rc.qp_num, exc)

    def _marker_done(self, wr_id: int) -> None:
        """Lock held: every WR posted before the marker has completed; the rest were never posted."""
        rc = self._marker_qp.pop(wr_id, None)
        if rc is None:
            return
        self._markers.give(1)
        self._release(rc, PeerLostError(f"write to {rc.owner} was not posted: the connection was reset"))

    def _expire_drains(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rc in [q for q in self._qps.values() if q.state == QpState.DRAINING and q.drain_deadline <= now]:
                log.warning("QP %d: no flush completions within %.1fs; destroying it", rc.qp_num,
                            self._drain_timeout_s)
                self._release(rc, PeerLostError(f"connection to {rc.owner} reset (drain timed out)"))
            self.changed.notify_all()

    def _release(self, rc: RcQp, error: KVTransferError) -> None:
        """Lock held: fail what is still outstanding, give its credits back, destroy."""
        handles = list(rc.outstanding.values())
        self._credits.give(len(handles))
        rc.outstanding.clear()
        self._commands.append(lambda: self._s.tracker.parts_done([(h, error) for h in handles]))
        self._kill(rc)

    def _kill(self, rc: RcQp) -> None:
        """Lock held: destroy and forget (the inbound source mapping is kept for late CQEs)."""
        destroy(rc)
        rc.move(QpState.DEAD)
        self._qps.pop(rc.qp_num, None)
        owned = self._owned.get(rc.owner, [])
        if rc in owned:
            owned.remove(rc)
        self._commands.append(self._check_dead_waiters)
        self.changed.notify_all()

    def _when_dead(self, owner: str, callback: Callable[[], None]) -> None:
        """Run ``callback`` (loop thread) once no QP of ``owner`` is DRAINING."""
        with self._lock:
            self._dead_waiters.append((owner, callback))
        self._check_dead_waiters()

    def _check_dead_waiters(self) -> None:
        with self._lock:
            ready = [(o, c) for o, c in self._dead_waiters
                     if not any(q.state == QpState.DRAINING for q in self._owned.get(o, ()))]
            self._dead_waiters = [w for w in self._dead_waiters if w not in ready]
        for _, callback in ready:
            callback()

    # -- async events ----------------------------------------------------------------------------
    def _read_async_events(self) -> None:
        while (event_type := self._dev.read_async_event()) is not None:
            name = async_event_name(event_type)
            log.warning("RDMA async event on %s: %s", self._dev.name, name)
            if name in ("QP_FATAL", "QP_REQ_ERR", "QP_ACCESS_ERR", "PATH_MIG_ERR", "DEVICE_FATAL", "PORT_ERR"):
                self._find_failed_qps(name)

    def _find_failed_qps(self, event: str) -> None:
        broken = []
        with self._lock:
            for rc in [q for q in self._qps.values() if q.state == QpState.READY]:
                try:
                    attr, _ = rc.qp.query(QP_STATE)
                    in_error = int(attr.qp_state) == IBV_QPS_ERR
                except Exception:   # noqa: BLE001 - cannot query: treat as failed
                    in_error = True
                if in_error and rc.owner not in self._broken and rc.qp_num not in self._sources:
                    self._broken.add(rc.owner)
                    broken.append((rc.owner, PeerLostError(f"QP {rc.qp_num} to {rc.owner} failed ({event})")))
        for owner, error in broken:
            self._on_broken(owner, error)
