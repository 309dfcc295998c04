"""The Registry gRPC service, connection brokering and the liveness monitor.

Lifecycle (`ControlPlane`):

1. ``start()`` binds the Registry gRPC server and starts two named threads:
   ``router-broker`` (runs brokering and teardown jobs one at a time from a queue) and
   ``router-monitor`` (every heartbeat interval: declares silent workers dead, re-queues
   brokering of pairs not yet linked).
2. Register -> `Membership.register` (version and compatibility hash checked) -> a brokering job
   links the newcomer with every live worker of the other role:
   ``Prefill.Describe`` -> ``Decode.Connect(prefill endpoint)`` -> decode endpoint ->
   ``Prefill.Connect(decode endpoint)``; both ends become CONNECTED (routable).
   Brokering runs off the Register call's thread, with retries until ``broker_timeout_s``.
3. Leave, death (no heartbeat for ``dead_after_s``) or re-registration -> the member is GONE and
   a teardown job calls ``Disconnect(peer=gone)`` on each of its former peers.
4. ``close()`` stops the server, sets the stop event, joins both threads, closes channels.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from router.config import RouterConfig
from router.membership import Load, Member, Membership, Refused
from rpc import pdserve_pb2 as pb
from rpc.auth import ServerAuthInterceptor
from rpc import pdserve_pb2_grpc as pbg

log = logging.getLogger(__name__)


class RegistryServicer(pbg.RegistryServicer):
    """Register / Heartbeat / Leave, backed by a `Membership`. ``on_join(member)`` and
    ``on_gone(member)`` schedule brokering and teardown."""

    def __init__(self, membership: Membership, config: RouterConfig, router_id: str,
                 on_join: Callable[[Member], None], on_gone: Callable[[Member], None]):
        self._m = membership
        self._config = config
        self._router_id = router_id
        self._on_join = on_join
        self._on_gone = on_gone

    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        try:
            member, replaced = self._m.register(request.worker)
        except Refused as exc:
            log.warning("refused worker %r: %s", request.worker.worker_id, exc)
            return pb.RegisterResponse(accepted=False, reason=str(exc), router_id=self._router_id)
        log.info("worker %s (%s) registered at %s, engine %s", member.worker_id, member.role,
                 member.grpc_address, member.transfer_engine)
        if replaced is not None:
            self._on_gone(replaced)
        self._on_join(member)
        return pb.RegisterResponse(
            accepted=True, router_id=self._router_id,
            heartbeat_interval_ms=int(self._config.heartbeat_interval_s * 1000))

    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        known = self._m.heartbeat(request.worker_id, Load.from_pb(request.load))
        want = known and request.HasField("kv_events") and self._m.kv_index.apply(
            request.worker_id, request.kv_events)
        return pb.HeartbeatResponse(known=known, want_kv_snapshot=want)

    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        gone = self._m.leave(request.worker_id)
        if gone is not None:
            log.info("worker %s left", gone.worker_id)
            self._on_gone(gone)
        return pb.LeaveResponse()


@dataclass(frozen=True)
class _Link:
    prefill: Member
    decode: Member


@dataclass(frozen=True)
class _Teardown:
    gone: Member


class Broker:
    """Links (prefill, decode) pairs and tears links down, one job at a time on its thread.

    ``submit_join(member)`` queues links of ``member`` with every live opposite-role worker;
    ``submit_gone(member)`` queues Disconnect calls on its former peers. Failures are logged
    and the pair is retried by the monitor (`relink`) after ``broker_timeout_s``.
    """

    def __init__(self, membership: Membership, config: RouterConfig, metadata: tuple = ()):
        self._m = membership
        self._config = config
        self._md = metadata
        self._jobs: queue.Queue[_Link | _Teardown | None] = queue.Queue()
        self._channels: dict[str, tuple[str, grpc.Channel]] = {}
        self._pending: set[tuple[str, str, int, int]] = set()
        self._failed_at: dict[tuple[str, str, int, int], float] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="router-broker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Finish the queued jobs, stop and join the thread, close channels. Idempotent."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        for _, channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def submit_join(self, member: Member) -> None:
        for p, d in self._m.unlinked_pairs():
            if member.worker_id in (p.worker_id, d.worker_id):
                self._submit_link(p, d)

    def submit_gone(self, member: Member) -> None:
        self._jobs.put(_Teardown(member))

    def relink(self) -> None:
        """Queue every unlinked live pair not already queued and not failed recently."""
        now = time.monotonic()
        for p, d in self._m.unlinked_pairs():
            key = (p.worker_id, d.worker_id, p.epoch, d.epoch)
            if now - self._failed_at.get(key, -1e9) >= self._config.broker_timeout_s:
                self._submit_link(p, d)

    def _submit_link(self, p: Member, d: Member) -> None:
        key = (p.worker_id, d.worker_id, p.epoch, d.epoch)
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
        self._jobs.put(_Link(p, d))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, _Link):
                    self._link(job.prefill, job.decode)
                else:
                    self._teardown(job.gone)
            except Exception:  # one bad job must not kill the broker
                log.exception("broker job %r failed", job)

    def _link(self, p: Member, d: Member) -> None:
        key = (p.worker_id, d.worker_id, p.epoch, d.epoch)
        deadline = time.monotonic() + self._config.broker_timeout_s
        delay = 0.1
        try:
            while True:
                if not (_same(self._m.get(p.worker_id), p) and _same(self._m.get(d.worker_id), d)):
                    return
                try:
                    self._connect_pair(p, d)
                    if self._m.link(p.worker_id, d.worker_id, (p.epoch, d.epoch)):
                        log.info("linked %s -> %s", p.worker_id, d.worker_id)
                        self._failed_at.pop(key, None)
                    return
                except grpc.RpcError as exc:
                    if time.monotonic() + delay >= deadline:
                        log.error("could not link %s -> %s: %s %s", p.worker_id, d.worker_id,
                                  exc.code(), exc.details())
                        self._failed_at[key] = time.monotonic()
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
        finally:
            with self._lock:
                self._pending.discard(key)

    def _connect_pair(self, p: Member, d: Member) -> None:
        t, md = self._config.rpc_timeout_s, self._md
        prefill = pbg.PrefillStub(self._channel(p))
        decode = pbg.DecodeStub(self._channel(d))
        p_endpoint = prefill.Describe(pb.DescribeRequest(), timeout=t, metadata=md)
        d_side = decode.Connect(pb.ConnectRequest(peer_worker_id=p.worker_id,
                                                  peer_endpoint=p_endpoint), timeout=t, metadata=md)
        prefill.Connect(pb.ConnectRequest(peer_worker_id=d.worker_id,
                                          peer_endpoint=d_side.endpoint), timeout=t, metadata=md)

    def _teardown(self, gone: Member) -> None:
        for peer_id in gone.peers:
            peer = self._m.get(peer_id)
            if peer is None:
                continue
            stub = (pbg.PrefillStub if peer.role == "prefill" else pbg.DecodeStub)(self._channel(peer))
            try:
                stub.Disconnect(pb.DisconnectRequest(peer_worker_id=gone.worker_id),
                                timeout=self._config.rpc_timeout_s, metadata=self._md)
                log.info("disconnected %s from gone %s", peer_id, gone.worker_id)
            except grpc.RpcError as exc:
                log.warning("Disconnect(%s) on %s failed: %s", gone.worker_id, peer_id, exc.code())
        entry = self._channels.get(gone.worker_id)
        if entry is not None and self._m.get(gone.worker_id) is None:
            entry[1].close()
            del self._channels[gone.worker_id]

    def _channel(self, m: Member) -> grpc.Channel:
        entry = self._channels.get(m.worker_id)
        if entry is None or entry[0] != m.grpc_address:
            if entry is not None:
                entry[1].close()
            entry = (m.grpc_address, self._config.tls.channel(m.grpc_address))
            self._channels[m.worker_id] = entry
        return entry[1]


def _same(a: Member | None, b: Member) -> bool:
    return a is not None and a.epoch == b.epoch


class ControlPlane:
    """The router's control plane: Registry server + broker + monitor over one `Membership`.

    ``registry_port`` is the bound port after ``start()`` (useful with port 0).
    """

    def __init__(self, config: RouterConfig, membership: Membership | None = None,
                 metadata: tuple = (), secret: bytes | None = None):
        """``metadata``: sent with every call to a worker; ``secret``: when given, Registry
        calls without the cluster's control token are refused (UNAUTHENTICATED)."""
        self.config = config
        self.membership = membership or Membership()
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.broker = Broker(self.membership, config, metadata)
        self.registry_port: int | None = None
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="router-monitor", daemon=True)
        interceptors = [ServerAuthInterceptor(secret)] if secret is not None else []
        self._server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="router-registry"), interceptors=interceptors)
        pbg.add_RegistryServicer_to_server(RegistryServicer(
            self.membership, config, self.router_id, self.broker.submit_join,
            self.broker.submit_gone), self._server)

    def start(self) -> None:
        """Bind and start. Raises `RuntimeError` when the registry address cannot be bound."""
        try:
            self.registry_port = self.config.tls.add_port(self._server, self.config.registry_address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind the registry at {self.config.registry_address}: {exc}") from exc
        self._server.start()
        self.broker.start()
        self._monitor.start()
        log.info("registry listening on port %d", self.registry_port)

    def close(self) -> None:
        self._server.stop(grace=1.0).wait()
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join()
        self.broker.close()

    def _watch(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            for gone in self.membership.expire(self.config.dead_after_s):
                log.warning("worker %s missed heartbeats for %.1fs: declared dead",
                            gone.worker_id, self.config.dead_after_s)
                self.broker.submit_gone(gone)
            self.broker.relink()
