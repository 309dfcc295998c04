"""One call from a model path to a ready generator (model, tokenizer, KV pool)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DTYPES, WEIGHT_CHOICES, CacheConfig, ModelConfig, SchedulerConfig, kv_cache_dtype, weights_dtype
from engine.errors import ModelLoadError
from engine.generator import Generator
from engine.gguf_weights import load_gguf
from engine.hf_weights import load_hf_dir
from engine.kv_cache import KVPool
from engine.models.base import CausalLM
from engine.models.registry import model_class
from engine.tokenizer import Tokenizer
from engine.modelfile import resolve_model_path
from engine.weights import LlamaWeights

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A loaded model and its tokenizer. ``path`` is the resolved file or directory; ``weights``
    the mode it was loaded in (`engine.config.WEIGHT_MODES`)."""

    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    weights: str = "fp32"

    @property
    def dtype(self) -> str:
        """Activation dtype name ("float32", "bfloat16")."""
        return weights_dtype(self.weights)

    @property
    def pool_config(self) -> ModelConfig:
        """The shapes this process's KV pool holds: the model's, or with tensor parallelism rank
        0's share of the KV heads (`engine.tp.local_config`)."""
        return getattr(self.model, "local_config", self.config)

    @property
    def kv_dtype(self) -> str:
        """KV pool dtype name ("float32", "bfloat16"): what `CacheConfig.dtype` must be."""
        return kv_cache_dtype(self.weights)


def load_weights(path: str | Path, dtype: torch.dtype = torch.float32,
                 native: bool = False) -> tuple[ModelConfig, LlamaWeights]:
    """Load a GGUF file or a Hugging Face directory (config.json + *.safetensors).

    Args:
        path: a ``.gguf`` file or a directory.
        dtype: parameter dtype (float32 or bfloat16) of every dense tensor.
        native: keep the GGUF's Q4_0 / Q4_1 projections 4-bit (`engine.quant`).
    Raises:
        ModelLoadError: missing/malformed file, unsupported architecture, or ``native`` for a
            model with no Q4_0 / Q4_1 projection (a Hugging Face directory, an F16 GGUF).
    """
    path = Path(path)
    if path.is_dir():
        if native:
            raise ModelLoadError(f"{path}: native weights need a GGUF file with Q4_0/Q4_1/Q4_K tensors; "
                                 "this is a Hugging Face directory (use fp32 or bf16)")
        return load_hf_dir(path, dtype)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, dtype, native)
    raise ModelLoadError(f"not a model file or directory: {path}")


def set_torch_threads(num_threads: int | None) -> None:
    """Give this process its own small torch thread pool (default: 1, or $PDSERVE_THREADS)."""
    n = num_threads or int(os.environ.get("PDSERVE_THREADS", "1"))
    torch.set_num_threads(max(1, n))


def resolve_weights(weights: str, model: str | Path | None = None, device: str = "cpu") -> tuple[str, str]:
    """The ``--weights`` mode to load ``model`` in, and why: ``weights`` itself unless it is
    "auto", which picks the checkpoint's own format where this machine runs it natively (as vLLM's
    ``--dtype auto`` takes the checkpoint's dtype):

    - a GGUF file on the CPU whose projections are 4-bit (Q4_0, Q4_1, Q4_K: `engine.quant`):
      "native", the blocks as stored (llama.cpp's way), when this torch has the int4 kernel;
    - otherwise a checkpoint stored in 16 bits (a GGUF's F16 / BF16 / Q8_0 tensors, a Hugging
      Face ``dtype`` / ``torch_dtype`` of bfloat16 or float16): "bf16" on CUDA, or on a CPU that
      multiplies bfloat16 natively (AVX512-BF16, AMX; `engine.linear.bf16_matmul_fast`), else "fp32";
    - a float32 checkpoint, or one that names no dtype: "fp32", the reference mode.

    Returns:
        ``(mode, reason)``: a key of `engine.config.WEIGHT_MODES` and one line for the log.
    Raises:
        ValueError: ``weights`` is not one of `WEIGHT_CHOICES`.
        ModelLoadError: the model path does not exist; a config.json that cannot be read; a
            dtype field naming a dtype the engine does not serve (the field is named).
    """
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHT_CHOICES}, got {weights!r}")
    if weights != "auto":
        return weights, "asked for"
    from engine.linear import bf16_matmul_fast

    path = resolve_model_path(model)
    cuda = torch.device(device).type == "cuda"
    bf16_ok = cuda or bf16_matmul_fast()
    if path.is_dir():
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
        text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
        field = "dtype" if text.get("dtype") is not None else "torch_dtype"
        stored = text.get(field) or "float32"
        if stored not in DTYPES:
            raise ModelLoadError(f"config.json: {field}={stored!r} is not a dtype the engine serves ({sorted(DTYPES)})")
        if stored == "float32":
            return "fp32", f"the checkpoint's {field} is float32"
        if not bf16_ok:
            return "fp32", f"{stored} checkpoint, but this CPU has no native bfloat16 matmuls"
        return "bf16", f"the checkpoint's {field} is {stored}"
    from engine.modelfile import gguf_reader
    from engine.quant import NATIVE_TYPES, int4_kernel_available

    kinds = {t.tensor_type.name for t in gguf_reader(path).tensors}
    native = sorted(kinds & NATIVE_TYPES)
    if native and not cuda and int4_kernel_available():
        return "native", f"GGUF with {'/'.join(native)} projections, run as stored"
    if kinds <= {"F32"}:
        return "fp32", "float32 GGUF"
    if not bf16_ok:
        return "fp32", f"{'/'.join(sorted(kinds - {'F32'}))} GGUF, but this CPU has no native bfloat16 matmuls"
    return "bf16", f"{'/'.join(sorted(kinds - {'F32'}))} GGUF"


def load_model(model: str | Path | None = None, weights: str = "fp32", device: str = "cpu",
               gemv_copies: bool = True, compiled: bool = False, tensor_parallel_size: int = 1,
               threads: int | None = None, tp_extension: str | None = None,
               low_bit_threads: tuple[int, ...] | None = None, linear_backend: str = "auto") -> LoadedModel:
    """Load weights and tokenizer. ``model`` None means the default SmolLM2-135M-Instruct.

    Args:
        weights: "fp32", "bf16" or "native" (`engine.config.WEIGHT_MODES`), or "auto"
            (`resolve_weights`; the choice is logged and kept in ``LoadedModel.weights``).
        device: "cpu" or "cuda[:n]" (weights are moved there; matmuls use ``F.linear``).
        gemv_copies: keep float32 projections' plain weights for one-row inputs too
            (`engine.linear.Linear`): faster batch-1 decode, a second copy of them in memory;
            a prefill worker, which rarely runs one-token inputs, passes False.
        compiled: run the layers as compiled graphs (`engine.compiled`; built at the first
            passes of each shape kind: a one-token pass and a longer one).
        tensor_parallel_size: N > 1 shards the model over N processes (`engine.tp`): this one
            is rank 0 and ``LoadedModel.model`` an `engine.tp_ranks.TensorParallelModel`, whose
            KV pool comes from its ``create_pool`` (`make_pool`); ranks 1 .. N-1 are started as
            subprocesses with ``threads`` torch threads each (None: this process's count),
            running the rank extension ``tp_extension`` (``"module:factory"``, `engine.tp_ranks`).
        low_bit_threads: native weights: the torch thread counts passes run on, each timed for its
            own low-bit kernel (`engine.models.llama.LlamaModel`; None: one and the current count).
        linear_backend: the projections' kernels (`engine.linear.BACKENDS`; tensor parallel
            ranks take ``auto``).
    Raises:
        ModelLoadError / TokenizerError: missing or malformed files; native weights for a model
            with no 4-bit projections.
        engine.mlas.KernelUnavailable: native weights without onnxruntime (a dependency).
        engine.errors.TensorParallelError: a tensor-parallel rank exited while starting.
        ValueError: unknown weights mode; native weights on CUDA or without the int4 kernel in
            this torch build; bf16 weights on a CPU without native bfloat16 matmuls (emulated,
            several times slower than fp32; docs/PERFORMANCE.md, "bf16 mode without native
            bfloat16 matmuls"); a CUDA device on a machine without one, or fewer GPUs than
            tensor-parallel ranks (one GPU per rank, `engine.tp_ranks.rank_device`).
    """
    if weights == "auto":
        weights, why = resolve_weights(weights, model, device)
        log.info("--weights auto: %s (%s)", weights, why)
    weights_dtype(weights)   # raises ValueError for an unknown mode
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch sees no CUDA device")
    if dev.type == "cuda" and (dev.index or 0) + tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"tensor parallel size {tensor_parallel_size} on {device!r} needs a GPU per rank "
                         f"(cuda:{dev.index or 0} to cuda:{(dev.index or 0) + tensor_parallel_size - 1}); "
                         f"torch sees {torch.cuda.device_count()}")
    native = weights == "native"
    if weights == "bf16" and dev.type == "cpu":
        from engine.linear import bf16_matmul_fast

        if not bf16_matmul_fast():
            raise ValueError("--weights bf16 needs a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX); "
                             "this one would emulate it, ~5x slower than fp32: use --weights fp32 or native")
    if native:
        from engine.quant import int4_kernel_available

        if dev.type != "cpu":
            raise ValueError("native (4-bit) weights run on the CPU only; use --weights bf16 on CUDA")
        if not int4_kernel_available():
            raise ValueError("native weights need torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu), "
                             f"missing or wrong in torch {torch.__version__}; use --weights bf16")
    path = resolve_model_path(model)
    if tensor_parallel_size > 1:
        if compiled:
            raise ValueError("compiled layers do not run tensor-parallel yet; use --enforce-eager")
        from engine import tp_ranks

        built = tp_ranks.start(path, weights, tensor_parallel_size, device, threads or torch.get_num_threads(),
                               gemv_copies, build_model, tp_extension)
    else:
        built = build_model(path, weights, device, gemv_copies, None, compiled, low_bit_threads, linear_backend)
    return LoadedModel(path, built.config, built, Tokenizer.from_file(path), weights)


def build_model(path: str | Path, weights: str, device: str = "cpu", gemv_copies: bool = True,
                tp=None, compiled: bool = False, low_bit_threads: tuple[int, ...] | None = None,
                linear_backend: str = "auto") -> CausalLM:
    """The model of a resolved checkpoint ``path`` in a resolved ``weights`` mode on ``device``
    (`load_model` checked both); with ``tp`` (an `engine.tp.TPGroup`), that rank's shard.
    Raises ModelLoadError as `load_weights` does, and when the model cannot be split ``tp.size`` ways."""
    config, loaded = load_weights(path, DTYPES[weights_dtype(weights)], native=weights == "native")
    if tp is not None and tp.size > 1:
        from engine.tp import shard_weights

        loaded = shard_weights(config, loaded, tp.rank, tp.size)
    dev = torch.device(device)
    if dev.type != "cpu":
        loaded = _to_device(loaded, dev)
    # the model takes the weights over, dropping each original once packed (`LlamaModel`)
    model = model_class(config.architecture)(config, loaded, kv_dtype=DTYPES[kv_cache_dtype(weights)],
                                               gemv_copies=gemv_copies, compiled=compiled, tp=tp,
                                               low_bit_threads=low_bit_threads, linear_backend=linear_backend)
    del loaded
    release_freed_memory()
    return model


def make_pool(loaded: LoadedModel, cache: CacheConfig, buffer: torch.Tensor | None = None) -> KVPool:
    """The KV pool ``loaded``'s model runs over: a `KVPool` of ``cache`` on the model's device
    (over ``buffer`` if given, of at least ``KVPool.nbytes_for(loaded.pool_config, cache)`` bytes),
    or a tensor-parallel model's (`TensorParallelModel.create_pool`: rank 0's over ``buffer``, the
    other ranks' their own)."""
    create = getattr(loaded.model, "create_pool", None)
    if create is not None:
        return create(cache, buffer)
    return KVPool(loaded.config, cache, buffer=buffer, device=loaded.model.device)


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Loading converts every tensor once (GGUF blocks -> float32 -> packed layouts); glibc keeps the
    freed transients in its arenas, resident memory per worker that nothing uses again (measured:
    docs/PERFORMANCE.md, "KV pool and worker memory")."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _to_device(w, dev: torch.device):
    """``w`` (a tensor, None, a list or a dataclass of them: `LlamaWeights`) with every tensor on
    ``dev``; the tied head stays the embedding."""
    from dataclasses import fields, is_dataclass, replace

    if w is None:
        return None
    if isinstance(w, list):
        return [_to_device(x, dev) for x in w]
    if not is_dataclass(w):
        return w.to(dev)
    moved = {f.name: _to_device(getattr(w, f.name), dev) for f in fields(w) if f.init}
    if isinstance(w, LlamaWeights) and w.lm_head is w.embed:
        moved["lm_head"] = moved["embed"]
    return replace(w, **moved)


def build_generator(loaded: LoadedModel, cache: CacheConfig | None = None,
                    scheduler: SchedulerConfig | None = None) -> Generator:
    """A `Generator` with a fresh KV pool."""
    cache = cache or CacheConfig(dtype=loaded.kv_dtype)
    pool = make_pool(loaded, cache)
    return Generator(loaded.model, pool, loaded.tokenizer, scheduler or SchedulerConfig())
