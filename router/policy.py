"""Pair selection: which decode worker reserves a request's KV, which prefill worker computes it.

A policy orders candidates best first; the orchestrator tries them in that order (a decode
worker that answers RESOURCE_EXHAUSTED is skipped for the next). Heartbeat load figures are up to
one interval old, so the router adds what it has itself put on each worker since, and takes off
what it saw finish there since (`Inflight`).

- ``load``: decode by effective free blocks (heartbeat free blocks minus blocks this router
  reserved, plus blocks of requests this router saw finish, that no heartbeat reflects yet),
  then fewest running sequences; prefill by queued
  prompt tokens (heartbeat figure plus this router's in-flight Prefill calls' tokens).
- ``round_robin``: rotate through the candidates, ignoring load.
- ``kv``: KV-aware (Dynamo's KV router cost, in blocks, lower is better): for each candidate
  the blocks of the prompt it would have to compute (prefill) or receive (decode), i.e. the
  prompt's blocks minus the leading ones its prefix cache holds (`router.kvindex`), plus its
  load in blocks (decode: blocks in use; prefill: queued prompt tokens / block size). The blocks
  to compute or receive are weighted (Dynamo's ``overlap_score_weight``): 1 for prefill as in
  Dynamo, 4 for decode by default, where a missing block is sent over the data plane (and, in
  auto mode, computed there) while blocks in use stand for memory, not step time (a decode step
  reads the weights once for the whole batch): a conversation stays on the decode worker that
  holds it unless that one runs about two more conversations than another. Without an index (caching off, or just after a
  router restart) it is ``load`` in blocks.

Not thread safe: used from the HTTP event loop only.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.kvindex import KVIndex
from router.membership import Member

# A reservation counts as "not yet reflected" until this many heartbeats arrived after it:
# one heartbeat may have been sampled before the reservation and received after.
_HEARTBEATS_TO_REFLECT = 2


@dataclass
class Inflight:
    """What this router has put on, or seen leave, workers that their heartbeats may not show yet.

    ``reserved``: decode worker id -> list of (heartbeats seen at reservation, blocks).
    ``released``: decode worker id -> list of (heartbeats seen at the finish, blocks) of requests
    that finished there (their blocks are free or cached, evictable, now). Without it a
    conversation's next turn, sent the moment its answer ends, finds its own previous turn still
    counted as in use on the worker holding its KV, and may be sent away from it.
    ``prefill_tokens``: prefill worker id -> prompt tokens of Prefill calls in flight.
    ``colocated_tokens``: decode worker id -> prompt tokens of ServeColocated calls whose first
    token has not come back yet (their prefill is queued or under way there).
    """

    reserved: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    released: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    prefill_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    colocated_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add_reservation(self, decode: Member, blocks: int) -> None:
        self.reserved[decode.worker_id].append((decode.heartbeats, blocks))

    def add_release(self, decode: Member, blocks: int) -> None:
        """A request holding ``blocks`` blocks on ``decode`` finished."""
        self.released[decode.worker_id].append((decode.heartbeats, blocks))

    def pending_blocks(self, decode: Member) -> int:
        """Blocks reserved here that ``decode.load`` may not include; drops reflected ones."""
        return _unreflected(self.reserved, decode)

    def released_blocks(self, decode: Member) -> int:
        """Blocks of requests that finished that ``decode.load`` may still count in use."""
        return _unreflected(self.released, decode)

    def free_blocks(self, decode: Member) -> int:
        """``decode``'s free blocks as this router knows them: the heartbeat's, less what it
        reserved, plus what it saw finish since (at most the pool)."""
        free = decode.load.free_blocks - self.pending_blocks(decode) + self.released_blocks(decode)
        return min(free, decode.load.total_blocks) if decode.load.total_blocks else free

    def start_prefill(self, prefill_id: str, tokens: int) -> None:
        self.prefill_tokens[prefill_id] += tokens

    def end_prefill(self, prefill_id: str, tokens: int) -> None:
        _take(self.prefill_tokens, prefill_id, tokens)

    def start_colocated(self, decode_id: str, tokens: int) -> None:
        self.colocated_tokens[decode_id] += tokens

    def end_colocated(self, decode_id: str, tokens: int) -> None:
        _take(self.colocated_tokens, decode_id, tokens)


def _take(counts: dict[str, int], key: str, n: int) -> None:
    """``counts[key] -= n``, the key dropped at zero."""
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def sequence_blocks(prompt_tokens: int, generated: Sequence[int], block_size: int) -> int:
    """KV blocks a finished request held on its decode worker: its choices share the prompt's
    full blocks; each has its own partial prompt block and output blocks. ``generated``: output
    tokens per choice."""
    shared = prompt_tokens // block_size
    return shared + sum(-(-(prompt_tokens + g) // block_size) - shared for g in generated)


def _unreflected(entries: dict[str, list[tuple[int, int]]], decode: Member) -> int:
    live = [(hb, n) for hb, n in entries.get(decode.worker_id, ())
            if decode.heartbeats < hb + _HEARTBEATS_TO_REFLECT]
    if live:
        entries[decode.worker_id] = live
    else:
        entries.pop(decode.worker_id, None)
    return sum(n for _, n in live)


class Policy:
    """Orders candidates, best first. ``needed_blocks`` is the request's prompt blocks;
    ``hashes`` its chained block hashes (`engine.block_hash`), given to policies that set
    ``uses_hashes``."""

    name = "base"
    uses_hashes = False

    def order_decode(self, decodes: Sequence[Member], inflight: Inflight,
                     needed_blocks: int, hashes: Sequence[bytes] = ()) -> list[Member]:
        raise NotImplementedError

    def order_prefill(self, prefills: Sequence[Member], inflight: Inflight,
                      needed_blocks: int = 0, hashes: Sequence[bytes] = ()) -> list[Member]:
        raise NotImplementedError


class LoadPolicy(Policy):
    name = "load"

    def order_decode(self, decodes, inflight, needed_blocks, hashes=()):
        def key(m: Member):
            free = inflight.free_blocks(m)
            return (free < needed_blocks, -free, m.load.running + m.load.waiting, m.worker_id)
        return sorted(decodes, key=key)

    def order_prefill(self, prefills, inflight, needed_blocks=0, hashes=()):
        def key(m: Member):
            queued = m.load.queued_prompt_tokens + inflight.prefill_tokens.get(m.worker_id, 0)
            return (queued, m.load.waiting, m.worker_id)
        return sorted(prefills, key=key)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = {"decode": itertools.count(), "prefill": itertools.count()}

    def order_decode(self, decodes, inflight, needed_blocks, hashes=()):
        return self._rotate(decodes, "decode")

    def order_prefill(self, prefills, inflight, needed_blocks=0, hashes=()):
        return self._rotate(prefills, "prefill")

    def _rotate(self, members: Sequence[Member], role: str) -> list[Member]:
        ordered = sorted(members, key=lambda m: m.worker_id)
        if not ordered:
            return []
        k = next(self._turn[role]) % len(ordered)
        return ordered[k:] + ordered[:k]


class KVPolicy(Policy):
    """KV-aware ordering over ``index`` (see the module docstring); ``overlap_weight`` scales
    the blocks a prefill worker computes, ``decode_overlap_weight`` those a decode worker
    receives, against the load (Dynamo's ``overlap_score_weight``)."""

    name = "kv"
    uses_hashes = True

    def __init__(self, index: KVIndex, overlap_weight: float = 1.0, decode_overlap_weight: float = 4.0) -> None:
        self.index = index
        self.overlap_weight = overlap_weight
        self.decode_overlap_weight = decode_overlap_weight

    def order_decode(self, decodes, inflight, needed_blocks, hashes=()):
        def key(m: Member):
            free = inflight.free_blocks(m)
            new = needed_blocks - self.index.overlap(m.worker_id, hashes)
            used = m.load.total_blocks - free
            return (free < new, self.decode_overlap_weight * new + used, m.load.running + m.load.waiting,
                    m.worker_id)
        return sorted(decodes, key=key)

    def order_prefill(self, prefills, inflight, needed_blocks=0, hashes=()):
        def key(m: Member):
            queued = m.load.queued_prompt_tokens + inflight.prefill_tokens.get(m.worker_id, 0)
            new = needed_blocks - self.index.overlap(m.worker_id, hashes)
            return (self.overlap_weight * new + queued / max(1, m.block_size), m.load.waiting, m.worker_id)
        return sorted(prefills, key=key)


def avoid_last(members: Sequence[Member], avoid: set[str]) -> list[Member]:
    """``members`` (a policy's order) with the workers in ``avoid`` (those a failed attempt
    used) moved to the end, the order otherwise kept."""
    return sorted(members, key=lambda m: m.worker_id in avoid)


def make_policy(name: str, index: KVIndex | None = None, overlap_weight: float = 1.0,
                decode_overlap_weight: float = 4.0) -> Policy:
    """``"load"``, ``"round_robin"`` or ``"kv"`` (over ``index``, the membership's, with the
    weights of `KVPolicy`). Raises `ValueError` on another name, or "kv" without an index."""
    if name == "load":
        return LoadPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "kv":
        if index is None:
            raise ValueError("the kv policy needs a KV index")
        return KVPolicy(index, overlap_weight, decode_overlap_weight)
    raise ValueError(f"unknown policy {name!r}")
