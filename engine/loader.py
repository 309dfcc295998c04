"""One call from a model path to a ready generator (model, tokenizer, KV pool)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DTYPES, CacheConfig, ModelConfig, SchedulerConfig
from engine.generator import Generator
from engine.kv_cache import KVPool
from engine.model import LlamaModel
from engine.tokenizer import Tokenizer
from engine.modelfile import resolve_model_path
from engine.weights import load_weights


@dataclass
class LoadedModel:
    """A loaded model and its tokenizer. ``path`` is the resolved file or directory."""

    path: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer


def set_torch_threads(num_threads: int | None) -> None:
    """Give this process its own small torch thread pool (default: 1, or $PDSERVE_THREADS)."""
    n = num_threads or int(os.environ.get("PDSERVE_THREADS", "1"))
    torch.set_num_threads(max(1, n))


def load_model(model: str | Path | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load weights and tokenizer. ``model`` None means the default SmolLM2-135M-Instruct.
    ``device``: "cpu" or "cuda[:n]" (weights are moved there; matmuls use ``F.linear``).

    Raises:
        ModelLoadError / TokenizerError: missing or malformed files.
        ValueError: unknown dtype, or a CUDA device on a machine without one.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch sees no CUDA device")
    path = resolve_model_path(model)
    config, weights = load_weights(path, DTYPES[dtype])
    if dev.type != "cpu":
        weights = _to_device(weights, dev)
    return LoadedModel(path, config, LlamaModel(config, weights), Tokenizer.from_file(path))


def _to_device(w, dev: torch.device):
    from dataclasses import fields, replace

    from engine.weights import LayerWeights

    layers = [LayerWeights(**{f.name: getattr(l, f.name).to(dev) for f in fields(l)}) for l in w.layers]
    embed = w.embed.to(dev)
    lm_head = embed if w.lm_head is w.embed else w.lm_head.to(dev)
    return replace(w, embed=embed, layers=layers, final_norm=w.final_norm.to(dev), lm_head=lm_head)


def build_generator(loaded: LoadedModel, cache: CacheConfig | None = None,
                    scheduler: SchedulerConfig | None = None) -> Generator:
    """A `Generator` with a fresh KV pool."""
    cache = cache or CacheConfig(dtype=str(loaded.model.dtype).removeprefix("torch."))
    pool = KVPool(loaded.config, cache, device=loaded.model.device)
    return Generator(loaded.model, pool, loaded.tokenizer, scheduler or SchedulerConfig())
