"""Workloads: the prompts to send and how many tokens to ask for.

Two datasets, both seeded and reproducible:

- ``random``: prompts of random common English words, one word ~ one token in BPE tokenizers
  (each is a frequent word that such vocabularies hold whole with its leading space), so lengths
  are approximately right without a tokenizer. Lengths are drawn like vLLM's random dataset:
  uniform integers in ``[floor(len * (1 - r)), ceil(len * (1 + r))]``. The exact counts come back
  from the server's usage (``stream_options.include_usage``).
- ``sharegpt``: real conversations (``loadtest.sharegpt``).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from loadtest.config import BenchmarkConfig
from loadtest.sample import SampleRequest, approx_token_count
from loadtest.sharegpt import sharegpt_requests

WORDS = tuple("""
the of and to in is was for on that with as by at from his her it he she they we you are be this
have had not but what all were when there can an which their said if do will each about how up out
them then many some so these would other into has more two like him see time could no make than
first been its who now people my made over did down only way find use may water long little very
after words called just where most know get through back much before go good new write our used me
man too any day same right look think also around another came come work three word must because
does part even place well such here take why things help put years different away again off went
old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough took
sometimes four head above kind began almost live page got earth need far hand high year mother
light parts country father let night following picture being study second eyes soon times story
boys since white days ever paper hard near sentence better best across during today others sure
means knew try told young miles sun ways thing whole hear example heard several change answer room
sea against top turned learn point city play toward five using himself usually money seen car
""".split())


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive ``(low, high)`` for lengths around ``length`` (vLLM's random dataset), low >= 1."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[SampleRequest]:
    """``num`` prompts of random words; same arguments, same prompts."""
    rng = np.random.default_rng(seed)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_low, in_high + 1, size=num)
    out_lens = rng.integers(out_low, out_high + 1, size=num)
    requests = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        words = rng.choice(len(WORDS), size=n_in)
        prompt = " ".join(WORDS[i] for i in words.tolist())
        requests.append(SampleRequest(prompt, n_in, n_out))
    return requests


def sample_requests(config: BenchmarkConfig,
                    count_tokens: Callable[[str], int] = approx_token_count) -> list[SampleRequest]:
    """The workload ``config`` describes: ``config.num_prompts`` requests (fewer only if a
    ShareGPT file holds fewer usable conversations). Raises ``DatasetError`` if none."""
    if config.dataset == "random":
        return random_requests(config.num_prompts, config.random_input_len,
                               config.random_output_len, config.random_range_ratio, config.seed)
    return sharegpt_requests(config.num_prompts, seed=config.seed, path=config.dataset_path,
                             output_len=config.sharegpt_output_len, count_tokens=count_tokens)
