"""Prefix-cache warm-ups: after a disaggregated request finished, its prefill worker is asked to
compute the request's output into its prefix cache (``Prefill.Warm``).

Why: in a conversation, turn t+1's prompt is turn t's prompt + turn t's answer + a new message.
The prefill worker cached turn t's prompt when it computed it, but the answer was decoded on the
decode worker; without a warm-up the next turn's prefill recomputes the whole answer (up to
``max_tokens`` tokens) before reaching the new message, and that recomputation is on the
critical path of the next turn's TTFT. With it, the answer is computed while the user reads and
types (the prefill worker runs warm-ups only when no prefill is queued), and the next turn
computes the new message alone. The alternative, sending the decoded blocks back over the data
plane, costs bytes instead of idle prefill compute; the trade is in docs/ARCHITECTURE.md.

A warm-up is best effort: its failure (worker gone, queue full, dropped for room) is counted and
logged at debug level, never seen by a request. The KV index (`router.kvindex`) is told of the
warmed blocks when the call returns, before the worker's next heartbeat says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from engine.block_hash import block_hashes
from router.clients import WorkerCallError, WorkerClient
from router.kvindex import KVIndex
from router.membership import Member
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


def warmup_tokens(prompt: Sequence[int], output: Sequence[int], block_size: int) -> list[int]:
    """The tokens a warm-up of a finished request computes: prompt + output minus the last output
    token (its K/V was never computed), or [] when that adds no full block to what the prefill
    worker cached (the prompt's full blocks before its last token)."""
    tokens = [*prompt, *output][:-1]
    if not output or len(tokens) // block_size <= (len(prompt) - 1) // block_size:
        return []
    return tokens


class Warmups:
    """Sends warm-ups and tracks them; ``close()`` cancels those in flight.

    ``client_of(member)``: the router's client for a worker. Event-loop only.
    """

    def __init__(self, metrics: RouterMetrics, index: KVIndex, client_of: Callable[[Member], WorkerClient],
                 timeout_s: float):
        self.metrics, self.index, self._client_of, self.timeout_s = metrics, index, client_of, timeout_s
        self._tasks: set[asyncio.Task] = set()

    def after_finish(self, prefill: Member, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Warm ``prefill``'s cache with ``prompt`` + ``output`` (if it has a cache and that adds a
        block); returns at once."""
        if not prefill.prefix_caching:
            return
        tokens = warmup_tokens(prompt, output, prefill.block_size)
        if tokens:
            task = asyncio.get_running_loop().create_task(self._warm(prefill, f"{request_id}~warm", tokens),
                                                          name=f"warmup-{request_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _warm(self, prefill: Member, request_id: str, tokens: list[int]) -> None:
        try:
            resp = await self._client_of(prefill).warm(request_id, tokens, self.timeout_s)
        except WorkerCallError as exc:
            self.metrics.prefill_warmups.labels("failed").inc()
            log.debug("warm-up %s on %s failed: %s", request_id, prefill.worker_id, exc)
            return
        if resp.dropped:
            self.metrics.prefill_warmups.labels("dropped").inc()
            return
        self.metrics.prefill_warmups.labels("completed").inc()
        self.metrics.prefill_warmup_tokens.inc(resp.computed_tokens)
        self.index.predict(prefill.worker_id, block_hashes(tokens, prefill.block_size))

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel the warm-ups in flight and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
