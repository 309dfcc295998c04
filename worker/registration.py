"""Registration with the router: Register, a heartbeat every interval carrying load, Leave.

Lifecycle: `RegistrationClient.start` spawns the named thread ``registry-client``: it registers
(retrying while the router is unreachable), then heartbeats; a heartbeat answered ``known=False``
(the router restarted or declared this worker dead) triggers a new registration. `close` stops
the thread, joins it and sends Leave (best effort, bounded by a deadline).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.auth import TLSFiles, client_interceptor

log = logging.getLogger(__name__)


class RegistrationRefused(Exception):
    """The router refused this worker (protocol version or compatibility hash mismatch)."""


class RegistrationClient:
    """Keeps one worker registered with the router.

    Args:
        router: host:port of the Registry service.
        info: this worker's `WorkerInfo`.
        load: called on every heartbeat for the current `LoadStats`.
        interval_s: heartbeat period (seconds), unless the router says otherwise.
        on_refused: called once with the reason if the router refuses registration; the thread
            then stops.
        secret: the cluster secret; its control token (`rpc.auth`) goes with every call.
        kv_events: with a prefix cache, ``kv_events(snapshot) -> (is_snapshot, stored, removed)``
            (`engine.kv_cache.BlockAllocator.take_events`); every heartbeat carries its result
            as `KVEvents`. A snapshot goes after each registration, after a heartbeat that
            failed (its events may be lost) and when the router asks for one.
    """

    def __init__(self, router: str, info: pb.WorkerInfo, load: Callable[[], pb.LoadStats],
                 interval_s: float = 1.0, on_refused: Callable[[str], None] | None = None,
                 secret: bytes | None = None, tls: TLSFiles | None = None,
                 kv_events: Callable[[bool], tuple[bool, list[bytes], list[bytes]]] | None = None):
        self._router = router
        self._info = info
        self._load = load
        self._kv_events = kv_events
        self._kv_snapshot = True   # the next heartbeat sends every cached hash
        self._interval = interval_s
        self._on_refused = on_refused
        self._stop = threading.Event()
        self._channel = (tls or TLSFiles()).channel(router)
        channel = self._channel if secret is None else grpc.intercept_channel(self._channel,
                                                                                client_interceptor(secret))
        self._stub = pb_grpc.RegistryStub(channel)
        self._thread = threading.Thread(target=self._run, name="registry-client", daemon=True)
        self.registered = threading.Event()
        self._refused = False

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.registered.is_set():
                if not self._register():
                    if self._refused:
                        return
                    self._stop.wait(min(self._interval, 1.0))
                    continue
            self._stop.wait(self._interval)
            if self._stop.is_set():
                break
            self._heartbeat()

    def _register(self) -> bool:
        try:
            resp = self._stub.Register(pb.RegisterRequest(worker=self._info), timeout=10.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return self._refuse("the router rejected this worker's cluster token (wrong secret)")
            log.debug("register with %s failed: %s", self._router, exc.code())
            return False
        if not resp.accepted:
            return self._refuse(resp.reason)
        if resp.heartbeat_interval_ms:
            self._interval = resp.heartbeat_interval_ms / 1000.0
        log.info("registered with router %s as %s", self._router, self._info.worker_id)
        self._kv_snapshot = True
        self.registered.set()
        return True

    def _refuse(self, reason: str) -> bool:
        log.error("router %s refused worker %s: %s", self._router, self._info.worker_id, reason)
        self._refused = True
        if self._on_refused:
            self._on_refused(reason)
        return False

    def _heartbeat(self) -> None:
        request = pb.HeartbeatRequest(worker_id=self._info.worker_id, load=self._load())
        if self._kv_events is not None:
            snapshot, stored, removed = self._kv_events(self._kv_snapshot)
            request.kv_events.snapshot = snapshot
            request.kv_events.stored.extend(stored)
            request.kv_events.removed.extend(removed)
            self._kv_snapshot = False
        try:
            resp = self._stub.Heartbeat(request, timeout=max(self._interval, 1.0))
        except grpc.RpcError as exc:
            log.debug("heartbeat failed: %s", exc.code())
            self._kv_snapshot = True   # its events may be lost
            return
        if not resp.known:
            log.warning("router no longer knows %s; registering again", self._info.worker_id)
            self.registered.clear()
        elif resp.want_kv_snapshot:
            self._kv_snapshot = True

    def leave(self, timeout_s: float = 3.0) -> None:
        """Tell the router this worker is leaving (best effort)."""
        try:
            self._stub.Leave(pb.LeaveRequest(worker_id=self._info.worker_id), timeout=timeout_s)
        except grpc.RpcError as exc:
            log.debug("leave failed: %s", exc.code())

    def close(self, leave: bool = True) -> None:
        """Stop heartbeating, join the thread, then Leave (if asked) and close the channel."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)
        if leave and self.registered.is_set():
            self.leave()
        self._channel.close()
