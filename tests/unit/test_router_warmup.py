"""What a prefix-cache warm-up computes (`router.warmup.warmup_tokens`) and the router's switch."""

from __future__ import annotations

import argparse

from router.config import RouterConfig
from router.warmup import warmup_tokens


def test_warmup_covers_prompt_and_output_but_the_last_token():
    prompt, output = list(range(40)), list(range(100, 130))
    assert warmup_tokens(prompt, output, 16) == prompt + output[:-1]


def test_no_warmup_when_the_output_adds_no_full_block():
    # the prefill worker registered the prompt's full blocks before its last token: 2 of 16
    assert warmup_tokens(list(range(40)), [7, 8, 9], 16) == []       # 42 tokens: still 2 blocks
    assert warmup_tokens(list(range(40)), [], 16) == []
    assert warmup_tokens(list(range(33)), list(range(16)), 16) != []   # 48 tokens: a third block


def _parse(argv):
    ap = argparse.ArgumentParser()
    RouterConfig.add_arguments(ap)
    return RouterConfig.from_args(ap.parse_args(argv))


def test_warmup_is_on_by_default_and_can_be_turned_off():
    assert _parse([]).prefill_warmup is True
    assert _parse(["--no-prefill-warmup"]).prefill_warmup is False
    assert _parse(["--policy", "kv"]).policy == "kv"


class _HangingWorker:
    """FAKE (named as such): a prefill worker that never answers Warm, to show that the router's
    close() stops warm-ups in flight; a real worker cannot be made to hang on purpose."""

    def __init__(self):
        self.calls = []

    async def warm(self, request_id, token_ids, timeout_s):
        import asyncio
        self.calls.append((request_id, len(token_ids)))
        await asyncio.Event().wait()


def test_close_cancels_warmups_in_flight_and_caching_off_sends_none():
    import asyncio
    import dataclasses

    from router.kvindex import KVIndex
    from router.metrics import RouterMetrics
    from router.warmup import Warmups
    from tests.unit.test_router_policy import member

    worker = _HangingWorker()

    async def main():
        w = Warmups(RouterMetrics(), KVIndex(), lambda m: worker, timeout_s=60)
        caching = dataclasses.replace(member("p0", "prefill"), prefix_caching=True)
        w.after_finish(caching, "r1", list(range(40)), list(range(30)))
        w.after_finish(member("p1", "prefill"), "r2", list(range(40)), list(range(30)))   # no cache
        await asyncio.sleep(0.05)
        assert w.in_flight == 1 and worker.calls == [("r1~warm", 69)]
        await w.close()
        assert w.in_flight == 0

    asyncio.run(main())
