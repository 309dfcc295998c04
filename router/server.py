"""Run a router process: tokenizer, control plane (Registry + broker + monitor), HTTP API.

Lifecycle of `serve`: load the tokenizer and the context length from the model files, start the
`ControlPlane` (workers can register from then on), serve HTTP with uvicorn until SIGINT/SIGTERM
(uvicorn's own handlers: in-flight responses get ``graceful_s`` to finish), then close the
control plane (stops the Registry server, joins the broker and monitor threads).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from router.api import build_state, create_app
from router.apikey import install_api_key
from router.config import RouterConfig
from router.membership import Membership
from router.registry import ControlPlane
from router.serving import decode_standalone

log = logging.getLogger(__name__)


def load_tokenizer(model: str | None):
    """(tokenizer, context length in tokens, resolved model path) of a GGUF file or HF directory.

    Raises `engine.errors.ModelLoadError` / `TokenizerError` on missing or malformed files.
    """
    from engine.errors import ModelLoadError
    from engine.tokenizer import Tokenizer
    from engine.modelfile import resolve_model_path

    path = resolve_model_path(model)
    tokenizer = Tokenizer.from_file(path)
    if not tokenizer.context_length:
        raise ModelLoadError(f"{path}: no context length in the model metadata")
    return tokenizer, tokenizer.context_length, path


def read_secret(config: RouterConfig) -> bytes:
    """The cluster secret (`rpc.auth.read_secret`: ``secret_file``, else ``$PDSERVE_SECRET``)."""
    from rpc.auth import read_secret as read

    return read(config.secret_file)


def read_api_key(config: RouterConfig) -> str | None:
    """The HTTP API key: ``api_key_file``, else ``$PDSERVE_API_KEY``, else None (no key)."""
    if config.api_key_file:
        return Path(config.api_key_file).read_text().strip() or None
    return os.environ.get("PDSERVE_API_KEY") or None


def control_metadata(config: RouterConfig) -> tuple[tuple[str, str], ...]:
    """gRPC metadata authenticating the router to workers (`rpc.auth` control token)."""
    from rpc.auth import call_metadata

    return call_metadata(read_secret(config))


def serve(config: RouterConfig, graceful_s: float = 5.0) -> int:
    """Run until stopped; returns the process exit code."""
    import uvicorn

    tokenizer, context, path = load_tokenizer(config.model)
    context = config.context_length or context
    secret = read_secret(config)
    metadata = control_metadata(config)
    membership = Membership(standalone_decode=decode_standalone(config.serving_mode))
    control = ControlPlane(config, membership, metadata, secret)
    control.start()
    try:
        state = build_state(config, tokenizer, context, membership, str(path), metadata)
        app = create_app(state)
        install_api_key(app, read_api_key(config))
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.http_host, port=config.http_port, log_level="warning",
            timeout_graceful_shutdown=graceful_s, access_log=False))
        log.info("OpenAI API on http://%s:%d (model %s, context %d)", config.http_host,
                 config.http_port, config.served_model_name, context)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers in place that re-raise is a no-op and close() below still runs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run()
        return 0 if server.started else 1
    finally:
        control.close()
