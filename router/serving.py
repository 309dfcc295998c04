"""Serving modes: which path a request takes, and what the cluster needs to be healthy.

Two paths serve a request (`ServingPath`):

- ``disaggregated``: a prefill worker computes the prompt's KV and writes it into a decode
  worker's pool (Reserve -> Prefill -> Decode), see `router.orchestrator`.
- ``colocated``: one decode worker runs the prefill itself on its own pool and streams every
  token (``Decode.ServeColocated``); no KV moves and no prefill worker is involved.

The router's ``serving_mode`` (`RouterConfig`) picks between them per request:

- ``disaggregated`` (default): always the disaggregated path.
- ``colocated``: always the colocated path; prefill workers are not needed.
- ``auto``: prompts with fewer than ``colocated_threshold_tokens`` tokens *to compute* go
  colocated, the rest disaggregated; when no linked (prefill, decode) pair exists, every request
  goes colocated. Tokens to compute are the prompt's minus the longest prefix a decode worker
  holds in its prefix cache (the router's KV index), as Dynamo's conditional disaggregation:
  a later turn of a conversation, whose earlier turns and answers sit on its decode worker, is
  prefilled there (only its new message) instead of recomputed and sent by a prefill worker.
  A longer prompt also goes colocated while the prefill side is backed up: every prefill worker
  already has ``auto_prefill_backlog_tokens`` prompt tokens or more in flight from this router
  (Dynamo's conditional disaggregation sends a prefill to the prefill queue only while that
  queue is short). Otherwise, at a load the prefill workers cannot keep up with, the prompts
  queue for them while the decode workers idle between steps, and TTFT grows with the queue
  (measured with ``python -m loadtest.peers``: docs/PERFORMANCE.md, "Serving modes: auto mode's
  prefill backlog rule"; the decode steps that carry prompt chunks are slower).

In ``colocated`` and ``auto`` modes a decode worker is routable as soon as it registers (it
needs no prefill peer for ServeColocated), so /health only asks for one decode worker.
"""

from __future__ import annotations

import enum
from typing import Mapping, Sequence

SERVING_MODES = ("disaggregated", "colocated", "auto")


class ServingPath(enum.Enum):
    """How one request is served; the value is the metrics label."""

    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


def check_mode(mode: str, threshold_tokens: int) -> None:
    """Validate a (serving mode, colocated threshold) pair. Raises `ValueError`."""
    if mode not in SERVING_MODES:
        raise ValueError(f"serving_mode must be one of {SERVING_MODES}, got {mode!r}")
    if threshold_tokens < 0:
        raise ValueError(f"colocated_threshold_tokens must be >= 0, got {threshold_tokens}")
    if threshold_tokens and mode != "auto":
        raise ValueError(f"colocated_threshold_tokens applies to serving_mode 'auto' only "
                         f"(got serving_mode {mode!r}); pass --serving-mode auto")


def choose_path(mode: str, threshold_tokens: int, prompt_tokens: int,
                pair_available: bool, prefill_backlogged: bool = False) -> ServingPath:
    """The path of a request of ``prompt_tokens`` tokens. Only consulted in ``auto`` mode:
    ``pair_available``: a linked (prefill, decode) pair is routable right now;
    ``prefill_backlogged``: every prefill worker has its backlog of prompt tokens or more in
    flight."""
    if mode == "colocated":
        return ServingPath.COLOCATED
    if mode == "disaggregated":
        return ServingPath.DISAGGREGATED
    if prompt_tokens < threshold_tokens or not pair_available or prefill_backlogged:
        return ServingPath.COLOCATED
    return ServingPath.DISAGGREGATED


def prefill_backlogged(prefill_workers: Sequence, inflight_tokens: Mapping[str, int], bound: int) -> bool:
    """Whether every one of ``prefill_workers`` (routable members, with ``worker_id``) has at
    least ``bound`` prompt tokens in flight (``inflight_tokens``: worker id -> tokens); False
    when ``bound`` is 0 or there is no prefill worker."""
    return bound > 0 and bool(prefill_workers) and all(
        inflight_tokens.get(p.worker_id, 0) >= bound for p in prefill_workers)


def decode_standalone(mode: str) -> bool:
    """Whether a decode worker is routable without any prefill peer in ``mode``."""
    return mode != "disaggregated"


def healthy(mode: str, prefill_workers: int, decode_workers: int) -> bool:
    """Whether the router can serve requests with these routable worker counts."""
    if decode_standalone(mode):
        return decode_workers >= 1
    return prefill_workers >= 1 and decode_workers >= 1
