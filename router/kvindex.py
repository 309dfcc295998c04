"""The router's index of what each worker holds in its prefix cache (KV-aware routing).

Workers with a prefix cache publish its changes on every heartbeat (`rpc` ``KVEvents``, from
`engine.kv_cache.BlockAllocator.take_events`): chained block hashes (`engine.block_hash`) that
became cached or were evicted, or a snapshot of all of them. The index keeps one set of hashes
per worker; `KVIndex.overlap` says how many leading blocks of a prompt a worker holds. As
Dynamo's KV router, but with one flat set per worker instead of a radix tree: a chained hash
names a whole prefix, so the longest held prefix is the first miss walking the prompt's hashes.

Events arrive up to a heartbeat late, so the router also records what its own placements are
about to cache (`KVIndex.predict`, as Dynamo's router does): the prompt on the chosen prefill
and decode workers when the request is placed, the prompt and its output on the decode worker
when it finishes. A prediction counts like an event for ``PREDICTION_TTL_S``, long enough for the
real event to arrive (a wrong one, such as a request aborted before its KV was in, just ends).

The index is advisory. A worker checks its own cache when it serves the request (the decode
worker's Reserve, the prefill worker's lookup), so an index that is stale by a heartbeat, or
empty after a router restart (the workers register again and send snapshots: it rebuilds within
one heartbeat interval), costs a cache miss, never a wrong result.

Thread safety: one lock; the registry's gRPC threads write, the HTTP event loop reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from rpc import pdserve_pb2 as pb


PREDICTION_TTL_S = 5.0


class KVIndex:
    """worker id -> the block hashes its prefix cache holds. ``clock``: monotonic seconds
    (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._held: dict[str, set[bytes]] = {}
        self._predicted: dict[str, dict[bytes, float]] = {}   # worker -> hash -> expiry
        self.evictions: dict[str, int] = {}   # removed events per worker since it registered

    def predict(self, worker_id: str, hashes: Sequence[bytes], ttl_s: float = PREDICTION_TTL_S) -> None:
        """Count ``hashes`` as held by ``worker_id`` for ``ttl_s`` seconds (a placement of ours
        is about to cache them there)."""
        until = self._clock() + ttl_s
        with self._lock:
            if worker_id not in self._held:
                return   # not indexed (no cache, or gone): nothing to predict into
            predicted = self._predicted.setdefault(worker_id, {})
            if len(predicted) > 4 * len(hashes) + 4096:   # drop expired ones now and then
                now = self._clock()
                for h in [h for h, t in predicted.items() if t <= now]:
                    del predicted[h]
            for h in hashes:
                predicted[h] = until

    def apply(self, worker_id: str, events: pb.KVEvents) -> bool:
        """Apply one heartbeat's events; True when the router needs a snapshot first (it has
        none for this worker: registered since, or this router restarted), in which case
        incremental events are ignored."""
        with self._lock:
            held = self._held.get(worker_id)
            if events.snapshot:
                self._held[worker_id] = set(events.stored)
                self.evictions.setdefault(worker_id, 0)
                return False
            if held is None:
                return True
            held.update(events.stored)
            held.difference_update(events.removed)
            predicted = self._predicted.get(worker_id)
            if predicted:
                for h in events.removed:
                    predicted.pop(h, None)
            self.evictions[worker_id] = self.evictions.get(worker_id, 0) + len(events.removed)
            return False

    def drop(self, worker_id: str) -> None:
        """Forget a worker (gone, or registered again: its next heartbeat brings a snapshot)."""
        with self._lock:
            self._held.pop(worker_id, None)
            self._predicted.pop(worker_id, None)
            self.evictions.pop(worker_id, None)

    def overlap(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` (a prompt's chained block hashes, in order)
        ``worker_id`` holds (or a placement of ours predicted); 0 for a worker without an index."""
        now = self._clock()
        with self._lock:
            held = self._held.get(worker_id)
            if held is None:
                return 0
            predicted = self._predicted.get(worker_id, {})
            n = 0
            for h in hashes:
                if h not in held and predicted.get(h, 0.0) <= now:
                    break
                n += 1
            return n

    def sizes(self) -> dict[str, int]:
        """worker id -> number of blocks indexed."""
        with self._lock:
            return {w: len(h) for w, h in self._held.items()}
