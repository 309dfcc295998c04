"""The worker's gRPC server: ``grpc.aio`` on an event loop of its own thread.

Streams (Decode, ServeColocated) and long calls (Prefill, Abort waiting for the writer) are coroutines,
so none pins a thread: Abort, Stats and Reserve are answered within their deadline at any number
of open streams. Work that takes a worker lock runs in a small executor (``<role>-ctl``), off the
event loop. Lifecycle: `AioServer.start` starts the thread ``<role>-grpc`` and returns once the
port is bound; `AioServer.stop` stops the server (grace for calls in flight), then the loop, and
joins the thread and the executor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from rpc.auth import AioServerAuthInterceptor, TLSFiles

log = logging.getLogger(__name__)


class AioServer:
    """A ``grpc.aio`` server serving on its own thread.

    Args:
        role: "prefill" or "decode" (names the threads).
        address: ``host:port`` to bind (port 0: any).
        add_services: ``add_services(server)`` registers the servicers.
        secret: the cluster secret (calls without its token get UNAUTHENTICATED).
        tls: certificates (TLS when enabled).
    """

    def __init__(self, role: str, address: str, add_services: Callable[[grpc.aio.Server], None],
                 secret: bytes, tls: TLSFiles, ctl_threads: int = 4) -> None:
        self._role, self._address, self._add, self._secret, self._tls = role, address, add_services, secret, tls
        self.executor = ThreadPoolExecutor(ctl_threads, thread_name_prefix=f"{role}-ctl")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._done: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"{role}-grpc", daemon=True)

    def start(self, timeout_s: float = 30.0) -> int:
        """Start serving; returns the bound port. Raises `OSError` when the address cannot be bound."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise OSError(f"gRPC server on {self._address} did not start within {timeout_s}s")
        if self._error is not None:
            raise OSError(f"cannot serve gRPC on {self._address}: {self._error}") from self._error
        return self.port

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.set_default_executor(self.executor)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._done = asyncio.Event()
        try:
            self._server = grpc.aio.server(interceptors=[AioServerAuthInterceptor(self._secret)],
                                           options=[("grpc.so_reuseport", 0)])
            self._add(self._server)
            self.port = self._tls.add_port(self._server, self._address)
            if self.port == 0:
                raise OSError("bind failed")
            await self._server.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._done.wait()

    @property
    def alive(self) -> bool:
        """True while the server's thread runs."""
        return self._thread.is_alive()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting calls, give calls in flight ``grace_s`` seconds, stop and join the
        thread and the executor. Idempotent."""
        if self.loop is not None and self._thread.is_alive() and self._server is not None:
            async def _stop():
                await self._server.stop(grace_s)
                self._done.set()
            try:
                asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(grace_s + 10)
            except Exception:
                log.exception("gRPC server did not stop cleanly")
        self._thread.join(timeout=grace_s + 15)
        self.executor.shutdown(wait=True, cancel_futures=True)
