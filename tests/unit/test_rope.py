"""`engine.models.rope.RotaryEmbedding`: which table rows each token of a batch gets (the
numerics are checked against transformers in tests/integration/test_rope_length_dependent.py)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import ForwardBatch, SeqChunk
from engine.config import ModelConfig, RopeScaling
from engine.models.rope import RotaryEmbedding, rope_tables

pytestmark = pytest.mark.unit

BLOCK, ORIGINAL = 16, 32


def config(scaling: RopeScaling | None, max_position: int = 128) -> ModelConfig:
    return ModelConfig(name="t", vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5, max_position=max_position,
                       tie_word_embeddings=True, rope_scaling=scaling, rotary_dim=12)


LONGROPE = RopeScaling("longrope", 4.0, ORIGINAL, short_factor=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5),
                       long_factor=(2.0, 2.0, 3.0, 3.0, 4.0, 4.0))
DYNAMIC = RopeScaling("dynamic", 4.0, ORIGINAL)


def batch(*seqs: tuple[int, int]) -> ForwardBatch:
    """One chunk per ``(start, tokens)``, each sequence its own blocks."""
    chunks, next_block = [], 0
    for start, n in seqs:
        blocks = -(-(start + n) // BLOCK)
        chunks.append(SeqChunk([1] * n, start, list(range(next_block, next_block + blocks))))
        next_block += blocks
    return ForwardBatch.build(chunks, BLOCK)


def expected(cfg: ModelConfig, seqs, dtype=torch.float32) -> torch.Tensor:
    """``cos`` rows as a sequence of length ``start + n`` gets them alone, for each sequence."""
    rows = []
    for start, n in seqs:
        cos, _ = rope_tables(cfg, dtype, seq_len=start + n)
        rows.append(cos[start:start + n])
    return torch.cat(rows)


def test_position_only_types_look_up_one_table():
    cfg = config(RopeScaling("linear", 2.0))
    cos, sin = RotaryEmbedding(cfg, torch.float32).cos_sin(batch((0, 5), (40, 1)))
    want_cos, want_sin = rope_tables(cfg, torch.float32)
    rows = torch.tensor([0, 1, 2, 3, 4, 40])
    assert cos.shape == (6, 1, 12)
    assert torch.equal(cos[:, 0], want_cos[rows]) and torch.equal(sin[:, 0], want_sin[rows])


@pytest.mark.parametrize("scaling", [LONGROPE, DYNAMIC], ids=["longrope", "dynamic"])
def test_each_sequence_gets_the_rows_of_its_own_length(scaling):
    """Within the original context (a length of exactly ``ORIGINAL`` included) the short /
    unscaled rows; past it, the rows of that sequence's length, whatever else is in the batch."""
    cfg = config(scaling)
    seqs = [(0, ORIGINAL), (0, 10), (40, 1), (ORIGINAL, 20), (ORIGINAL - 1, 1), (90, 1)]
    cos, _ = RotaryEmbedding(cfg, torch.float32).cos_sin(batch(*seqs))
    assert torch.equal(cos[:, 0], expected(cfg, seqs))
    short = rope_tables(cfg, torch.float32, seq_len=ORIGINAL)[0]
    assert torch.equal(cos[:ORIGINAL, 0], short[:ORIGINAL])
    assert not torch.equal(cos[ORIGINAL + 10, 0], short[40])   # the sequence at 40 is past the original


def test_longrope_scales_both_tables_by_its_attention_factor():
    cfg = config(LONGROPE)
    cos, sin = RotaryEmbedding(cfg, torch.float32).cos_sin(batch((0, 1), (60, 1)))
    factor = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(float(ORIGINAL)))).sqrt()
    assert torch.allclose(cos[0, 0], torch.full((12,), float(factor)))   # position 0: cos 1, times the factor
    assert torch.allclose(cos[1, 0] ** 2 + sin[1, 0] ** 2, torch.full((12,), float(factor) ** 2))


def test_dynamic_rows_past_the_original_follow_the_length_in_the_model_dtype():
    cfg = config(DYNAMIC)
    rope = RotaryEmbedding(cfg, torch.bfloat16)
    cos, sin = rope.cos_sin(batch((60, 1), (0, 80)))
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (81, 1, 12)
    assert torch.equal(cos[:, 0], expected(cfg, [(60, 1), (0, 80)], torch.bfloat16))
    assert rope._cos.shape[0] == ORIGINAL   # only the unscaled rows are kept
