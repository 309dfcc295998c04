"""Sampling parameters and the sampler: pure logic."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import SamplingError, SamplingParams, sample

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": tuple("abcdefghijklmnopq")}, "stop"),
])
def test_invalid_params_raise(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3) == logits.argmax(-1).tolist()


def test_seed_reproducible_and_top_k_one_is_greedy():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits, [p], [p.make_generator()])[0] for _ in range(3)]
    assert len(set(a)) == 1
    k1 = SamplingParams(temperature=1.5, top_k=1, seed=1)
    assert sample(logits, [k1], [k1.make_generator()]) == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0, -10.0]])
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    gen = p.make_generator()
    assert {sample(logits, [p], [gen])[0] for _ in range(50)} == {0}
    p = SamplingParams(temperature=1.0, top_p=0.99, seed=3)
    gen = p.make_generator()
    assert {sample(logits, [p], [gen])[0] for _ in range(200)} == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=7)
    gen = p.make_generator()
    draws = torch.tensor([sample(logits, [p], [gen])[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_a_row_with_nan_or_inf_fails_alone_and_masked_tokens_are_fine():
    logits = torch.randn(5, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :10] = float("-inf")   # masked tokens: still a valid row
    expected = logits[4].argmax().item()
    for temperature in (0.0, 0.7):
        out = sample(logits, [SamplingParams(temperature=temperature, seed=1)] * 5, [None] * 5)
        assert all(isinstance(out[r], SamplingError) for r in (1, 2, 3))
        assert isinstance(out[0], int) and isinstance(out[4], int) and out[4] >= 10
        if temperature == 0.0:
            assert out[0] == logits[0].argmax().item() and out[4] == expected
