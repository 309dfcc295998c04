"""Architecture name -> model class: how a checkpoint finds the family that runs it.

The names are the checkpoint's own: a Hugging Face ``config.json``'s ``model_type`` and a GGUF
file's ``general.architecture`` (the two agree for the families served). The weights loader
(`engine.weights`) reads the name into `ModelConfig.architecture`; `model_class` turns it into
the class to build, and refuses a name no family implements.
"""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.models.llama import LlamaModel

ARCHITECTURES: dict[str, type] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,   # a Llama network with a sliding window on every layer
    "qwen2": LlamaModel,     # Q/K/V biases
    "qwen3": LlamaModel,     # per-head Q/K RMSNorm
    "qwen3_moe": LlamaModel,  # Qwen3 with routed experts (engine.models.moe)
    "mixtral": LlamaModel,   # Mistral with routed experts
    "phi3": LlamaModel,      # fused qkv / gate_up tensors in the checkpoint, partial rotary
    "gemma2": LlamaModel,    # GeGLU, (1 + w) norms around attention and MLP, soft-capping, alternating windows
    "gemma3_text": LlamaModel,  # Gemma 2 with Q/K norms, a local rope base for the sliding layers
}


def model_class(architecture: str) -> type:
    """The `engine.models.base.CausalLM` class for ``architecture``.

    Raises:
        ModelLoadError: no family here implements ``architecture`` (the message names it and
            the supported ones).
    """
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}") from None
