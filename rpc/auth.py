"""Control-plane authentication: every gRPC call carries a token derived from the cluster secret.

The token is ``HMAC-SHA256(secret, "pdserve-control/v<PROTOCOL_VERSION>")`` in hex, sent as the
``x-pdserve-token`` metadata entry; servers compare it in constant time and answer
``UNAUTHENTICATED`` otherwise. Without TLS the token crosses the network in clear text (it proves
membership, it does not hide traffic); give certificates (`server_credentials` /
`channel_credentials`) to encrypt and authenticate the channel as well.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

from rpc import PROTOCOL_VERSION

TOKEN_HEADER = "x-pdserve-token"
DEV_SECRET = b"pdserve-development-secret-do-not-use"
SECRET_ENV = "PDSERVE_SECRET"


def read_secret(path: str | None) -> bytes:
    """The cluster secret every member uses: the contents of ``path``, else ``$PDSERVE_SECRET``,
    else `DEV_SECRET` (development only). The one place the secret is read from the environment."""
    import os

    if path:
        return Path(path).read_bytes().strip()
    env = os.environ.get(SECRET_ENV)
    return env.encode() if env else DEV_SECRET


def control_token(secret: bytes) -> str:
    """The bearer token all cluster members derive from ``secret`` (bytes, >= 16)."""
    if len(secret) < 16:
        raise ValueError("the cluster secret must be at least 16 bytes")
    return hmac.new(secret, f"pdserve-control/v{PROTOCOL_VERSION}".encode(), hashlib.sha256).hexdigest()


class ServerAuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the cluster token (status UNAUTHENTICATED)."""

    def __init__(self, secret: bytes):
        self._token = control_token(secret).encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        md = dict(handler_call_details.invocation_metadata or ())
        got = md.get(TOKEN_HEADER, "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


class AioServerAuthInterceptor(grpc.aio.ServerInterceptor):
    """`ServerAuthInterceptor` for ``grpc.aio`` servers (the worker services)."""

    def __init__(self, secret: bytes):
        self._token = control_token(secret).encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
            yield  # pragma: no cover - makes this an async generator

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, handler_call_details):
        md = dict(handler_call_details.invocation_metadata or ())
        got = md.get(TOKEN_HEADER, "")
        handler = await continuation(handler_call_details)
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token):
            return handler
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


class _ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._md = ((TOKEN_HEADER, token),)

    def _details(self, d):
        md = tuple(d.metadata or ()) + self._md
        return d._replace(metadata=md) if hasattr(d, "_replace") else _Details(d, md)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = d.wait_for_ready, d.compression
        self.metadata = metadata


def client_interceptor(secret: bytes):
    """A sync-channel interceptor adding the token (``grpc.intercept_channel(ch, it)``)."""
    return _ClientAuth(control_token(secret))


def call_metadata(secret: bytes) -> tuple[tuple[str, str], ...]:
    """Metadata to pass explicitly (e.g. with grpc.aio calls)."""
    return ((TOKEN_HEADER, control_token(secret)),)


def server_credentials(cert_file: str, key_file: str, ca_file: str) -> grpc.ServerCredentials:
    """Mutual-TLS credentials for a server from PEM files: its own certificate and key, and the
    CA every client certificate must be signed by (``require_client_auth``: a client without a
    certificate of that CA fails the TLS handshake)."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())],
                                       root_certificates=Path(ca_file).read_bytes(),
                                       require_client_auth=True)


def channel_credentials(ca_file: str, cert_file: str | None = None,
                        key_file: str | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for a client: the CA the server's certificate must be signed by, and this
    client's certificate and key (mutual TLS)."""
    return grpc.ssl_channel_credentials(
        Path(ca_file).read_bytes(), Path(key_file).read_bytes() if key_file else None,
        Path(cert_file).read_bytes() if cert_file else None)


class TLSFiles:
    """PEM files for mutual TLS between cluster members: ``cert``/``key`` of this process and the
    ``ca`` that signed every member's certificate. Servers require a client certificate of that
    CA; clients present theirs and check the server's. All None: plaintext gRPC (the cluster
    token still authenticates members)."""

    def __init__(self, cert: str | None = None, key: str | None = None, ca: str | None = None):
        given = [x is not None for x in (cert, key, ca)]
        if any(given) and not all(given):
            raise ValueError("TLS needs all of --tls-cert, --tls-key and --tls-ca")
        self.cert, self.key, self.ca = cert, key, ca

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def add_port(self, server, address: str) -> int:
        """Bind ``server`` (sync or aio) to ``address``, with TLS when enabled."""
        if self.enabled:
            return server.add_secure_port(address, server_credentials(self.cert, self.key, self.ca))
        return server.add_insecure_port(address)

    def channel(self, address: str) -> grpc.Channel:
        if self.enabled:
            return grpc.secure_channel(address, channel_credentials(self.ca, self.cert, self.key))
        return grpc.insecure_channel(address)

    def aio_channel(self, address: str):
        if self.enabled:
            return grpc.aio.secure_channel(address, channel_credentials(self.ca, self.cert, self.key))
        return grpc.aio.insecure_channel(address)
