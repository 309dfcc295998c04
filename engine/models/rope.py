"""Rotary position embeddings: the inverse frequencies of every rope type the engine serves, and
the ``cos`` / ``sin`` tables the model indexes by position.

Formulas: Hugging Face ``transformers/modeling_rope_utils.py`` (the reference the engine's output
is compared with), which cite their sources: linear interpolation (kaiokendev), Llama 3's
wavelength-banded scaling (Meta's ``llama3`` reference code), YaRN (Peng et al. 2023,
arXiv:2309.00071, section 3.2-3.4), dynamic NTK (Reddit's /u/bloc97 and /u/emozilla) and
LongRoPE (Microsoft's implementation, as Phi-3 uses it).

Most types depend on the position alone: one table, looked up by position. ``dynamic`` and
``longrope`` also depend on the sequence's length when the forward pass runs (transformers'
``dynamic_rope_update``: ``seq_len = max(position_ids) + 1`` of that call); `RotaryEmbedding`
applies that per sequence of a batch (its docstring says why, and what it means for chunked
prefill). K is rotated once, when written into the paged pool, and keeps that rotation, as
transformers' cache keeps it.
"""

from __future__ import annotations

import math

import torch

from engine.attention import ForwardBatch
from engine.config import ModelConfig, RopeScaling

LENGTH_DEPENDENT = ("dynamic", "longrope")
"""Rope types whose frequencies depend on the sequence's length at the forward pass."""


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                    seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_factor)``: ``[head_dim // 2]`` float32 inverse frequencies (radians
    per token) and the factor ``cos`` and ``sin`` are multiplied by (1.0 but for YaRN and
    longrope). ``seq_len``: the sequence's length at this forward pass (its last position + 1),
    read by the `LENGTH_DEPENDENT` types only; 0: the short / unscaled frequencies.

    Raises:
        ValueError: a rope type with no formula here."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "dynamic":
        return _dynamic(exponents, head_dim, theta, scaling, seq_len), 1.0
    if scaling.rope_type == "longrope":
        return _longrope(exponents, theta, scaling, seq_len)
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


def _dynamic(exponents: torch.Tensor, dim: int, theta: float, s: RopeScaling, seq_len: int) -> torch.Tensor:
    """Dynamic NTK: past the original context ``L``, the base becomes
    ``theta * (factor * n / L - (factor - 1)) ** (dim / (dim - 2))`` for a sequence of ``n``
    tokens (``_compute_dynamic_ntk_parameters``; computed in float32 tensors as there)."""
    if seq_len <= s.original_max_position:   # transformers keeps (resets to) the original frequencies
        return 1.0 / (theta ** exponents)
    n = torch.tensor(max(seq_len, s.original_max_position), dtype=torch.int64)
    base = theta * ((s.factor * n / s.original_max_position) - (s.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** exponents)


def _longrope(exponents: torch.Tensor, theta: float, s: RopeScaling, seq_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE: each frequency divided by its ``long_factor`` for a sequence longer than the
    original context, by its ``short_factor`` otherwise; attention factor (both cases) the
    checkpoint's, else ``sqrt(1 + ln(factor) / ln(original))`` (1 for ``factor <= 1``)
    (``_compute_longrope_parameters``)."""
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position))
    ext = s.long_factor if seq_len > s.original_max_position else s.short_factor
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** exponents), float(attention)


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


def rope_tables(config: ModelConfig, dtype: torch.dtype, seq_len: int = 0,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``, each ``[rows, rotary_dim]`` in ``dtype`` (``rows``: default
    ``config.max_position``; ``rotary_dim``: `ModelConfig.rotary_dim`, or ``head_dim`` when 0):
    Hugging Face's ``cos`` and ``sin`` (angles in float32, times the attention factor), the first
    half of ``sin`` negated so that rotation is one ``roll`` (see `engine.models.llama._rotate`).
    ``seq_len``: as `inv_frequencies` takes it (`LENGTH_DEPENDENT` types only)."""
    dim = config.rotary_dim or config.head_dim
    inv_freq, attention = inv_frequencies(dim, config.rope_theta, config.rope_scaling, seq_len)
    positions = torch.arange(config.max_position if rows is None else rows, dtype=torch.float32)
    return _tables(positions, inv_freq, attention, dtype)


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention: float,
            dtype: torch.dtype, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of ``positions``, computed ``chunk`` rows at a time (elementwise, so the same
    values; a 128k-position model's float32 temporaries would otherwise add to a worker's peak
    memory while it loads)."""
    half = inv_freq.numel()
    cos = torch.empty(positions.numel(), 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    for lo in range(0, positions.numel(), chunk):
        freqs = torch.outer(positions[lo:lo + chunk], inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        c, s = emb.cos() * attention, emb.sin() * attention
        s[:, :half].neg_()
        cos[lo:lo + chunk], sin[lo:lo + chunk] = c, s
    return cos, sin


class RotaryEmbedding:
    """The ``cos`` / ``signed_sin`` rows of a batch's tokens, for every rope type.

    Position-only types: one precomputed table, looked up by position (nothing more per pass).

    ``dynamic`` and ``longrope`` follow transformers' ``dynamic_rope_update``, which picks the
    frequencies from the length seen in each forward call (``max(position_ids) + 1``): here that
    length is taken **per sequence**, each sequence's tokens rotated with the frequencies of its
    own length at this pass (its last position in the batch + 1, `ForwardBatch.seq_ranges`'
    context length). Per sequence, not per batch (vLLM takes the batch's longest): with a
    per-batch choice one request's length would change the rotation of another's tokens, so a
    request's output would depend on what it was batched with; per sequence, each request gets
    what transformers gives it run alone. K keeps the rotation it was written with: a prompt
    prefilled in two chunks rotates the first chunk with the first chunk's length (e.g. 100
    tokens, short factors / unscaled base under an original context of 128) and the second with
    the whole prompt's, exactly as transformers does when fed the same two chunks with a cache;
    each decode step rotates its one token with the length it reaches. A prompt's logits thus
    depend on how it was chunked (as they do in transformers), and a prefix cache that reuses
    another sequence's K reuses that sequence's rotation.

    transformers' ``dynamic`` is stateful across calls (it keeps the frequencies of the longest
    length seen until a call within the original context resets them); for one sequence, whose
    passes only grow, that is the frequencies of the current length, which is what is computed
    here, statelessly.

    Tables: ``longrope`` keeps two (short, long) of ``max_position`` rows and picks one per
    sequence (one index shift per pass); ``dynamic`` keeps the unscaled one
    (``original_max_position`` rows) for sequences within the original context and computes the
    rows of each longer one for its length (once per pass and sequence, not per layer).
    Position-only types cost what one table lookup costs.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """Raises:
            ValueError: a rope type with no formula here."""
        self.config, self.dtype = config, dtype
        s = config.rope_scaling
        self.kind = s.rope_type if s is not None and s.rope_type in LENGTH_DEPENDENT else None
        self.original = s.original_max_position if self.kind else 0
        if self.kind == "longrope":   # rows [0, max_position): short; [max_position, 2 max_position): long
            short, long = rope_tables(config, dtype), rope_tables(config, dtype, seq_len=self.original + 1)
            tables = (torch.cat([short[0], long[0]]), torch.cat([short[1], long[1]]))
        elif self.kind == "dynamic":
            tables = rope_tables(config, dtype, rows=min(self.original, config.max_position))
        else:
            tables = rope_tables(config, dtype)
        self._cos, self._sin = (t.to(device) for t in tables)

    def cos_sin(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)``: ``[T, 1, rotary_dim]`` each, in the model's dtype, on the tables'
        device (``batch`` already there), the rows of ``batch.positions`` (class docstring)."""
        if self.kind is None:
            return self._rows(batch.positions)
        if self.kind == "longrope":
            return self._rows(self._longrope_rows(batch))
        return self._dynamic(batch)

    def _rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos.index_select(0, rows)[:, None, :], self._sin.index_select(0, rows)[:, None, :]

    def _longrope_rows(self, batch: ForwardBatch) -> torch.Tensor:
        """Each token's row: its position, plus ``max_position`` (the long table) for the tokens
        of sequences longer than the original context."""
        ranges = batch.seq_ranges
        if all(end <= self.original for _, _, end, _ in ranges):
            return batch.positions
        long = torch.repeat_interleave(torch.tensor([end > self.original for _, _, end, _ in ranges]),
                                       torch.tensor([n for _, n, _, _ in ranges]))
        return batch.positions + long.to(batch.positions.device) * self.config.max_position

    def _dynamic(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        positions = batch.positions
        if all(end <= self.original for _, _, end, _ in batch.seq_ranges):
            return self._rows(positions)
        cos = torch.empty(positions.numel(), self._cos.shape[1], dtype=self.dtype, device=positions.device)
        sin = torch.empty_like(cos)
        c = self.config
        for first, n, end, _ in batch.seq_ranges:
            rows = slice(first, first + n)
            if end <= self.original:
                cos[rows], sin[rows] = (t.index_select(0, positions[rows]) for t in (self._cos, self._sin))
            else:
                inv_freq, attention = inv_frequencies(c.rotary_dim or c.head_dim, c.rope_theta, c.rope_scaling, end)
                cos[rows], sin[rows] = _tables(positions[rows].float(), inv_freq.to(positions.device),
                                               attention, self.dtype)
        return cos[:, None, :], sin[:, None, :]
