"""`engine.tp`'s sharding arithmetic: every row, head and expert lands on exactly one rank (or on
the ranks that replicate it), and what cannot be split is refused with the field named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.moe import ExpertWeights
from engine.quant import Int4Weight
from engine.tp import check_shardable, kv_heads_of, local_config, shard_weights, vocab_rows
from engine.weights import LayerWeights, LlamaWeights

CONFIG = ModelConfig(name="t", vocab_size=103, hidden_size=16, intermediate_size=64, num_layers=1, num_heads=8,
                     num_kv_heads=4, head_dim=4, rope_theta=1e4, rms_norm_eps=1e-5, max_position=64,
                     tie_word_embeddings=True, qkv_bias=True)


def weights(config: ModelConfig, experts: int = 0) -> LlamaWeights:
    g = torch.Generator().manual_seed(0)
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=g)
    layer = LayerWeights(attn_norm=torch.ones(16), wqkv=torch.randn(qkv, 16, generator=g),
                         wo=torch.randn(16, config.num_heads * config.head_dim, generator=g),
                         ffn_norm=torch.ones(16), w_gate_up=torch.randn(2 * config.intermediate_size, 16, generator=g),
                         w_down=torch.randn(16, config.intermediate_size, generator=g),
                         bqkv=torch.randn(qkv, generator=g))
    if experts:
        layer.experts = ExpertWeights(torch.randn(experts, 16, generator=g),
                                      [torch.randn(8, 16, generator=g) for _ in range(experts)],
                                      [torch.randn(16, 4, generator=g) for _ in range(experts)])
    return LlamaWeights(embed=embed, layers=[layer], final_norm=torch.ones(16), lm_head=embed)


@pytest.mark.parametrize("vocab,size", [(103, 1), (103, 2), (103, 4), (49152, 3), (5, 4)])
def test_vocab_rows_cover_the_vocabulary_once(vocab, size):
    spans = [vocab_rows(vocab, r, size) for r in range(size)]
    rows = [i for first, n in spans for i in range(first, first + n)]
    assert rows == list(range(vocab))


@pytest.mark.parametrize("kv,size,expect", [(4, 2, [(0, 2), (2, 2)]), (4, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
                                            (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]), (1, 2, [(0, 1), (0, 1)])])
def test_kv_heads_are_split_or_replicated_as_the_query_heads_read_them(kv, size, expect):
    config = dataclasses.replace(CONFIG, num_kv_heads=kv)
    assert [kv_heads_of(config, r, size) for r in range(size)] == expect
    group = config.num_heads // kv
    for r in range(size):   # every query head of rank r reads a KV head rank r holds
        first, n = kv_heads_of(config, r, size)
        heads = range(r * config.num_heads // size, (r + 1) * config.num_heads // size)
        assert all(first <= h // group < first + n for h in heads)


def test_shards_put_back_together_are_the_weights():
    size, c = 2, CONFIG
    full = weights(c)
    shards = [shard_weights(c, weights(c), r, size) for r in range(size)]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = full.layers[0]
    per = [s.layers[0] for s in shards]
    ql, kvl = q // size, kv // size
    for name in ("wqkv", "bqkv"):   # Q, K and V rows: rank 0's then rank 1's
        got = torch.cat([torch.cat([getattr(p, name)[:ql] for p in per]),
                         torch.cat([getattr(p, name)[ql:ql + kvl] for p in per]),
                         torch.cat([getattr(p, name)[ql + kvl:] for p in per])])
        assert torch.equal(got, getattr(layer, name))
    assert torch.equal(torch.cat([p.wo for p in per], dim=1), layer.wo)
    i = c.intermediate_size // size
    assert torch.equal(torch.cat([p.w_gate_up[:i] for p in per] + [p.w_gate_up[i:] for p in per]), layer.w_gate_up)
    assert torch.equal(torch.cat([p.w_down for p in per], dim=1), layer.w_down)
    assert torch.equal(torch.cat([s.embed for s in shards]), full.embed)
    assert all(s.lm_head is s.embed for s in shards)   # tied stays tied
    assert local_config(c, size).num_heads == 4 and local_config(c, size).num_kv_heads == 2


def test_experts_go_round_robin_and_the_router_is_replicated():
    c = dataclasses.replace(CONFIG, num_experts=4, num_experts_per_tok=2, moe_layers=(0,))
    shards = [shard_weights(c, weights(c, experts=4), r, 2) for r in range(2)]
    owned = [[e for e, w in enumerate(s.layers[0].experts.gate_up) if w is not None] for s in shards]
    assert owned == [[0, 2], [1, 3]]
    assert torch.equal(shards[0].layers[0].experts.router, shards[1].layers[0].experts.router)


def test_4bit_projections_split_on_their_groups_or_are_refused():
    def int4(rows, cols):
        g = torch.Generator().manual_seed(1)
        return Int4Weight(torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g),
                          torch.rand(rows, cols // 32, generator=g), torch.rand(rows, cols // 32, generator=g))

    c = dataclasses.replace(CONFIG, num_heads=4, num_kv_heads=2, head_dim=32)   # O's input: 128 features
    w = weights(c)
    w.layers[0].wo = int4(16, 128)
    wo = shard_weights(c, w, 1, 2).layers[0].wo   # input features [64, 128): groups 2 and 3
    full = int4(16, 128)
    assert torch.equal(wo.codes, full.codes[:, 64:]) and torch.equal(wo.scale, full.scale[:, 2:])
    assert torch.equal(wo.dequantize(), full.dequantize()[:, 64:])
    c = dataclasses.replace(CONFIG, head_dim=8)   # 8 heads x 8 over 4 ranks: slices of 16 features
    w = weights(c)
    w.layers[0].wo = int4(16, 64)
    with pytest.raises(ModelLoadError, match=r"layer 0 attention output: .* splits a group"):
        shard_weights(c, w, 1, 4)


@pytest.mark.parametrize("message,changes,size", [
    ("num_heads=8 is not divisible by tensor parallel size 3", {}, 3),
    ("num_kv_heads=3 is neither a multiple nor a divisor of tensor parallel size 2", {"num_heads": 6, "num_kv_heads": 3}, 2),
    ("intermediate_size=60 is not divisible by tensor parallel size 8", {"intermediate_size": 60}, 8),
    ("tensor parallel size must be >= 1", {}, 0),
])
def test_what_cannot_be_split_is_refused_naming_the_field(message, changes, size):
    with pytest.raises(ModelLoadError, match=message):
        check_shardable(dataclasses.replace(CONFIG, **changes), size)
