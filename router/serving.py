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
  A longer prompt also goes colocated while the prefill side is backed up (`colocate_on_placement`):
  every prefill worker already has ``auto_prefill_backlog_tokens`` prompt tokens or more in
  flight from this router (Dynamo's conditional disaggregation sends a prefill to the prefill
  queue only while that queue is short), and the decode worker's own queue of colocated prompts
  is the shorter wait. Otherwise, at a load the prefill workers cannot keep up with, the prompts
  queue for them while the decode workers idle between steps, and TTFT grows with the queue
  (measured with ``python -m loadtest.peers``: docs/PERFORMANCE.md, "Serving modes: auto mode's
  prefill backlog rule"; the decode steps that carry prompt chunks are slower).
  That choice is made when the request is placed (at the head of the router's admission queue),
  not when it arrives: a prompt that arrived while the prefill worker had room, and waits behind
  others, then takes whichever side can start it first, and a colocated prompt never queues
  behind one waiting for a prefill worker (measured: PERFORMANCE.md, "Auto mode: the path chosen
  at placement").

In ``colocated`` and ``auto`` modes a decode worker is routable as soon as it registers (it
needs no prefill peer for ServeColocated), so /health only asks for one decode worker.
"""

from __future__ import annotations

import enum
from typing import Sequence

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
                pair_available: bool) -> ServingPath | None:
    """The path of a request of ``prompt_tokens`` tokens as it arrives; None in ``auto`` mode
    when either may serve it, chosen when it is placed (`colocate_on_placement`).
    ``pair_available``: a linked (prefill, decode) pair is routable right now (only consulted
    in ``auto`` mode)."""
    if mode == "colocated":
        return ServingPath.COLOCATED
    if mode == "disaggregated":
        return ServingPath.DISAGGREGATED
    if prompt_tokens < threshold_tokens or not pair_available:
        return ServingPath.COLOCATED
    return None


def colocate_on_placement(prefill_tokens: Sequence[int], colocated_tokens: Sequence[int], tokens: int,
                          bound: int, decode_speed: float) -> bool:
    """Auto mode, when a prompt of ``tokens`` tokens that may go either way is placed: whether a
    decode worker should prefill it (colocated) rather than a prefill worker.

    Join the shortest expected delay, in prompt tokens: True when every prefill worker has at
    least ``bound`` prompt tokens in flight (``prefill_tokens``: one count per routable prefill
    worker) and the least-queued decode worker's colocated prompt tokens not yet started
    (``colocated_tokens``: one count per routable decode worker) plus ``tokens``, over
    ``decode_speed``, are at most the least-loaded prefill worker's plus ``tokens``.
    ``decode_speed`` is a decode worker's prefill rate relative to a prefill worker's: its prompt
    chunks share passes with its decode steps. False with no prefill worker or no decode worker,
    or ``bound`` 0 (the rule off)."""
    if bound <= 0 or not prefill_tokens or not colocated_tokens:
        return False
    least = min(prefill_tokens)
    return least >= bound and (min(colocated_tokens) + tokens) / decode_speed <= least + tokens


def decode_standalone(mode: str) -> bool:
    """Whether a decode worker is routable without any prefill peer in ``mode``."""
    return mode != "disaggregated"


def healthy(mode: str, prefill_workers: int, decode_workers: int) -> bool:
    """Whether the router can serve requests with these routable worker counts."""
    if decode_standalone(mode):
        return decode_workers >= 1
    return prefill_workers >= 1 and decode_workers >= 1
