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
