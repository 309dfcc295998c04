"""A Hugging Face model's ``generation_config.json``: its stop ids and its default sampling.

Applied the way vLLM's ``--generation-config auto`` applies it (vLLM ``ModelConfig.get_diff_sampling_param``
and the OpenAI request's ``to_sampling_params``): ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) are defaults for a request that
leaves the field unset, and a request's own value wins. Every value the file sets counts (with
transformers 5 every `GenerationConfig` default is None, so vLLM's ``to_diff_dict`` keeps them all).
``eos_token_id`` (an int or a list of ints) adds stop ids. Other keys (``do_sample``,
``bos_token_id``, ...) are not read. Imports nothing heavy: the router loads it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What ``generation_config.json`` says (None: the file does not set it).

    Fields:
        eos_token_ids: ids that end generation, besides the tokenizer's EOS.
        temperature: >= 0 (0: greedy).
        top_p: in (0, 1].
        top_k: >= -1 (0 and -1: disabled).
        min_p: in [0, 1] (0: disabled).
        repetition_penalty: > 0.
        max_tokens: >= 1, the file's ``max_new_tokens``: a chat request's default limit.
    Raises:
        ModelLoadError: a value of the wrong type or out of range.
    """

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self):
        checks = {"temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "top_k": lambda v: v >= -1,
                  "min_p": lambda v: 0 <= v <= 1, "repetition_penalty": lambda v: v > 0,
                  "max_tokens": lambda v: v >= 1}
        for name, ok in checks.items():
            value = getattr(self, name)
            integral = name in ("top_k", "max_tokens")
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int if integral else (int, float))
                    or not math.isfinite(value) or not ok(value)):
                raise ModelLoadError(f"{FILE}: {name} = {value!r} is not valid")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.eos_token_ids):
            raise ModelLoadError(f"{FILE}: eos_token_id must be an int or a list of ints, got {self.eos_token_ids!r}")

    def sampling(self) -> dict[str, float | int]:
        """The sampling defaults the file sets, by request field name (`SAMPLING_FIELDS`)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


def load_generation_config(directory: Path) -> GenerationDefaults:
    """The defaults of ``directory/generation_config.json`` (all unset when there is no file).

    Raises `ModelLoadError` when the file is not a JSON object or a value is invalid."""
    file = Path(directory) / FILE
    if not file.is_file():
        return GenerationDefaults()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: not a JSON object")
    eos = data.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return GenerationDefaults(eos_token_ids=eos, max_tokens=data.get("max_new_tokens"),
                              **{name: data.get(name) for name in SAMPLING_FIELDS})
