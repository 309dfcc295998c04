"""Rotary position embeddings: the inverse frequencies of every rope type the engine serves, and
the ``cos`` / ``sin`` tables the model indexes by position.

Formulas: Hugging Face ``transformers/modeling_rope_utils.py`` (the reference the engine's output
is compared with), which cite their sources: linear interpolation (kaiokendev), Llama 3's
wavelength-banded scaling (Meta's ``llama3`` reference code) and YaRN (Peng et al. 2023,
arXiv:2309.00071, section 3.2-3.4). Every type here depends on the position alone, so K rotated
once and kept in the paged pool stays valid as the sequence grows: types whose frequencies
depend on the batch's longest sequence (``dynamic``, ``longrope``) are not among them.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_factor)``: ``[head_dim // 2]`` float32 inverse frequencies (radians
    per token) and the factor ``cos`` and ``sin`` are multiplied by (1.0 but for YaRN)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"rope_type {scaling.rope_type!r} has no formula here")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths above ``original / low_freq_factor`` are divided by ``factor``, those below
    ``original / high_freq_factor`` kept, the band between interpolated smoothly."""
    old = s.original_max_position
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than ``beta_slow`` times over the original context are
    interpolated, more than ``beta_fast`` times extrapolated, a linear ramp between; the
    attention factor is ``0.1 ln(factor) + 1`` (or the mscale ratio, or the file's value)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        attention = (mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(factor))
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_tables(config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``, each ``[max_position, rotary_dim]`` in ``dtype`` (``rotary_dim``:
    `ModelConfig.rotary_dim`, or ``head_dim`` when 0): Hugging Face's ``cos`` and ``sin`` (angles
    in float32, times the attention factor), the first half of ``sin`` negated so that rotation is
    one ``roll`` (see `engine.models.llama._rotate`)."""
    dim = config.rotary_dim or config.head_dim
    inv_freq, attention = inv_frequencies(dim, config.rope_theta, config.rope_scaling)
    freqs = torch.outer(torch.arange(config.max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * attention, emb.sin() * attention
    sin[:, : dim // 2].neg_()
    return cos.to(dtype), sin.to(dtype)
