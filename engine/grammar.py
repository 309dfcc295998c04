"""Grammar-constrained decoding (structured outputs) with llguidance.

A request's grammar arrives as an llguidance grammar string (`router.structured` builds it from
the API's ``response_format`` / ``guided_*`` / ``structured_outputs`` / tool forms). Each
sequence that has one gets a `Matcher`: before a token is picked, `Matcher.allowed` gives the
tokens the grammar allows next (the sampler masks every other logit to -inf); after, the token is
consumed. The grammar's end allows only the stop tokens, so a finished structure ends the
sequence. Rows without a grammar never touch this module.

Across the prefill/decode split the matcher state is rebuilt, not shipped: the prefill worker
builds a matcher for its one token; the decode worker builds one from the grammar and consumes
the first token (and, on a resumed attempt, the earlier output at the end of the prompt), which
puts it in exactly the state it would have in one process (the grammar's state is a function of
the tokens consumed).

Why llguidance rather than xgrammar (`python -m bench.grammars` measures both on this model's
tokenizer): both compile a JSON schema and compute a mask fast enough to be noise beside a decode
step (measured: docs/PERFORMANCE.md, "Structured outputs"), both do JSON schema, regex and
context-free grammars; but llguidance is one 3 MB wheel with no dependencies, while xgrammar
pulls torch, transformers, triton and a TVM FFI runtime into every worker (and the router, which
validates grammars).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import llguidance
import llguidance.numpy as lgn   # not llguidance.torch: it imports torch.compile's stack
import numpy as np
import torch

from engine.errors import InvalidRequestError

_TEMPLATES = 64   # compiled grammars kept per process (LRU), copied per sequence


class Matcher:
    """One sequence's grammar state.

    Raises nothing itself: llguidance never raises for grammar or token errors; `consume`
    returns False and the matcher stays in an error state.
    """

    __slots__ = ("_m", "_bits", "_mask", "_vocab")

    def __init__(self, llmatcher, vocab_size: int):
        self._m = llmatcher
        self._vocab = vocab_size
        self._bits = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)   # llguidance writes here
        self._mask = torch.from_numpy(self._bits)                              # the same memory

    def allowed(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokens the grammar allows next (all False in an error state)."""
        lgn.fill_next_token_bitmask(self._m, self._bits)
        bits = (self._mask[0, :, None] >> _SHIFTS) & 1
        return bits.flatten()[:self._vocab].bool()

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; False when the grammar rejects one (then the matcher is
        in an error state for good)."""
        return bool(self._m.consume_tokens(list(token_ids))) if token_ids else not self._m.is_error()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def is_stopped(self) -> bool:
        """The structure is complete: nothing but a stop token can follow."""
        return self._m.is_stopped()


_SHIFTS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Builds `Matcher` objects for one tokenizer (thread-safe; the llguidance tokenizer is built
    on first use, once per `Grammars`; its cost: docs/PERFORMANCE.md, "Structured outputs").

    Args:
        tokenizer: an `engine.tokenizer.Tokenizer` (its Hugging Face ``tokenizers`` backend).
        stop_token_ids: the ids a finished structure may end with (EOS, end of turn).
    """

    def __init__(self, tokenizer, stop_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._stops = sorted(set(int(t) for t in stop_token_ids))
        self._lltok = None
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _llguidance_tokenizer(self):
        if self._lltok is None:
            self._lltok = llguidance.LLTokenizer(self._tokenizer.backend.to_str(),
                                                 n_vocab=self._tokenizer.vocab_size, eos_token=self._stops)
        return self._lltok

    def matcher(self, grammar: str, consumed: Sequence[int] = ()) -> Matcher:
        """A fresh matcher for ``grammar`` (an llguidance grammar string) that has consumed
        ``consumed`` (earlier output of a resumed request).

        Raises:
            InvalidRequestError: the grammar does not compile, or rejects ``consumed``.
        """
        with self._lock:
            template = self._templates.get(grammar)
            if template is None:
                template = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
                if template.is_error():
                    raise InvalidRequestError(f"the grammar does not compile: {template.get_error()}")
                self._templates[grammar] = template
                if len(self._templates) > _TEMPLATES:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(grammar)
            m = Matcher(template.deep_copy(), self._tokenizer.vocab_size)
        if not m.consume(consumed):
            raise InvalidRequestError(f"the grammar rejects the resumed output: {m.error}")
        return m


def matcher_for(grammars: Grammars | None, params, prompt_token_ids: Sequence[int],
                then: Sequence[int] = ()) -> Matcher | None:
    """The matcher of a sequence with ``params`` (an `engine.sampling.SamplingParams`): None
    without a grammar; else one that consumed the resumed output at the end of the prompt
    (``params.num_resumed`` tokens) and then ``then``.

    Raises:
        InvalidRequestError: a grammar but no ``grammars`` (no tokenizer), a grammar that does not
            compile, or tokens it rejects.
    """
    if not params.grammar:
        return None
    if grammars is None:
        raise InvalidRequestError("structured outputs need the model's tokenizer")
    resumed = list(prompt_token_ids[len(prompt_token_ids) - params.num_resumed:]) if params.num_resumed else []
    return grammars.matcher(params.grammar, resumed + list(then))
