"""One request of a workload, and the token estimate every workload uses without a tokenizer.

Shared by the workload builders (``datasets`` for random prompts, ``sharegpt``) and their users
(``client``, ``runner``): the builders import each other through nothing but this module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleRequest:
    """One request of the workload."""

    prompt: str
    """The prompt text (completions) or the user message (chat)."""
    prompt_len: int
    """Prompt length, tokens, as estimated client-side; replaced by the server's usage count."""
    expected_output_len: int
    """``max_tokens`` to ask for."""


def approx_token_count(text: str) -> int:
    """Tokens in ``text`` estimated without a tokenizer: ~4 characters per token, at least 1."""
    return max(1, round(len(text) / 4))
