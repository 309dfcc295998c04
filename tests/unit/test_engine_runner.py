"""The model runner (`engine.runner`) and the pass filler both roles schedule with
(`engine.scheduling.fill_pass`), on a tiny random Llama: blocks, the prefix cache, chunked
passes, sampling rows, and the model/pool check (`engine.models.base.check_pool`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from engine.attention import SeqChunk
from engine.config import CacheConfig, ModelConfig, RopeScaling
from engine.errors import ModelLoadError
from engine.kv_cache import KVPool
from engine.models.base import LayerKV, check_pool
from engine.models.llama import LlamaModel
from engine.models.registry import ARCHITECTURES, model_class
from engine.runner import ModelRunner
from engine.sampling import Row, SamplingParams
from engine.scheduling import PassBudget, fill_pass
from engine.weights import LayerWeights, LlamaWeights

pytestmark = pytest.mark.unit

BS = 4
TINY = ModelConfig(name="tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position=128, tie_word_embeddings=True)


def _model(seed: int = 0, config: ModelConfig = TINY, kv_dtype: torch.dtype | None = None) -> LlamaModel:
    g = torch.Generator().manual_seed(seed)
    c = config

    def w(*shape):   # scaled so attention is far from uniform (a wrong position changes the output)
        return torch.randn(*shape, generator=g) * 0.3

    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [LayerWeights(torch.ones(c.hidden_size), w(qkv, c.hidden_size), w(c.hidden_size, c.num_heads * c.head_dim),
                           torch.ones(c.hidden_size), w(2 * c.intermediate_size, c.hidden_size),
                           w(c.hidden_size, c.intermediate_size)) for _ in range(c.num_layers)]
    embed = w(c.vocab_size, c.hidden_size)
    return LlamaModel(c, LlamaWeights(embed, layers, torch.ones(c.hidden_size), embed), gemv_copies=False,
                      kv_dtype=kv_dtype)


@dataclass(eq=False)
class _Seq:
    """A `RunnerSeq` made of parts."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=4, temperature=0))
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list = field(default_factory=list)
    num_registered: int = 0
    prompt_logprobs: list | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@pytest.fixture(scope="module")
def model():
    return _model()


def _runner(model, caching=True, blocks=32):
    return ModelRunner(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=blocks)), caching)


def _prefill(runner, seq, chunk_tokens=None):
    """Compute ``seq``'s prompt in chunks of ``chunk_tokens``; returns the last pass's logits."""
    n = len(seq.prompt_token_ids)
    assert runner.grow(seq, n)
    step = chunk_tokens or n
    logits = None
    while seq.num_computed < n:
        end = min(n, seq.num_computed + step)
        chunk = SeqChunk(seq.prompt_token_ids[seq.num_computed:end], seq.num_computed, seq.block_table,
                         need_logits=end == n, prompt_logits=seq.prompt_logprobs is not None)
        logits = runner.execute([(seq, chunk)])
        runner.advance(seq, end - chunk.start)
    return logits


def test_chunked_and_cached_prefills_give_the_logits_of_one_pass(model):
    prompt = [int(t) for t in torch.randint(0, 64, (23,), generator=torch.Generator().manual_seed(1))]
    whole = _prefill(_runner(model), _Seq(prompt))
    chunked = _prefill(_runner(model), _Seq(prompt), chunk_tokens=5)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)

    runner = _runner(model)
    first = _Seq(prompt)
    _prefill(runner, first)
    assert first.num_registered == 23 // BS   # every full computed block is in the cache
    runner.release(first)
    again = _Seq(prompt)
    hit = runner.take_cached_prefix(again)
    assert hit == (23 - 1) // BS * BS == again.num_computed and again.num_registered == hit // BS
    torch.testing.assert_close(_prefill(runner, again), whole, atol=1e-5, rtol=1e-5)
    # a different token inside the cached prefix finds only the blocks before it
    other = _Seq(prompt[:6] + [(prompt[6] + 1) % 64] + prompt[7:])
    assert runner.take_cached_prefix(other) == BS


def test_a_wrong_position_changes_the_logits(model):
    """The comparison above can fail: the same tokens a block further on give other logits."""
    prompt = [int(t) for t in torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(2))]
    runner = _runner(model, caching=False)
    a = _Seq(prompt)
    ref = _prefill(runner, a)
    b = _Seq(prompt)
    assert runner.grow(b, BS + len(prompt))
    chunk = SeqChunk(prompt, BS, b.block_table)   # positions shifted by one block
    assert (runner.execute([(b, chunk)]) - ref).abs().max() > 1e-3


def test_prompt_logprobs_want_every_position_so_nothing_is_taken_from_the_cache(model):
    prompt = list(range(1, 14))
    runner = _runner(model)
    _prefill(runner, _Seq(prompt))
    seq = _Seq(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1), prompt_logprobs=[])
    assert runner.tokens_to_compute(seq) == len(prompt) and runner.take_cached_prefix(seq) == 0
    _prefill(runner, seq, chunk_tokens=5)
    assert [lp.token_id for lp in seq.prompt_logprobs] == prompt[1:]


def test_grow_is_all_or_nothing_and_reset_and_release_give_every_block_back(model):
    runner = _runner(model, blocks=4)
    alloc = runner.pool.allocator
    seq = _Seq(list(range(1, 11)))
    assert not runner.grow(seq, 5 * BS) and seq.block_table == [] and alloc.num_free == 4
    _prefill(runner, seq)
    assert alloc.num_free == 1
    runner.release(seq)
    assert seq.block_table == [] and seq.num_computed == 10 and alloc.num_free == 4   # cached ones count
    seq2 = _Seq(list(range(1, 11)))
    assert runner.take_cached_prefix(seq2) == 8 and alloc.num_free == 2
    runner.reset(seq2)
    assert seq2.num_computed == 0 and seq2.num_registered == 0 and alloc.num_free == 4
    with pytest.raises(ValueError):
        runner.take_cached_prefix(_Seq([1, 2], block_table=[0]))


def test_rows_growing_in_turn_keep_their_blocks_consecutive(model):
    """Decode rows growing one block at a time, interleaved (as a decode step grows its batch),
    each keep consecutive block ids: the room `grow` leaves after a new run (as far as the row's
    ``max_tokens`` reaches) and its growth into that room."""
    runner = _runner(model, caching=False, blocks=64)
    seqs = [_Seq(list(range(1, 7)), params=SamplingParams(max_tokens=10, temperature=0)) for _ in range(3)]
    for s in seqs:
        assert runner.grow(s, 6)
    for n in range(7, 17):
        for s in seqs:
            assert runner.grow(s, n)
    for s in seqs:
        assert len(s.block_table) == 4 and s.block_table == list(range(s.block_table[0], s.block_table[0] + 4))


def test_sample_maps_rows_to_logits_rows_and_a_bad_row_fails_alone(model):
    runner = _runner(model, caching=False)
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    rows = [Row(greedy, None, [1]), Row(greedy, None, [1]), Row(greedy, None, [1])]
    out = runner.sample(logits, rows, [1, 0, 1])
    assert [t for t, _ in out] == [0, 1, 0] and out[1][1].token_id == 1
    bad = runner.sample(torch.tensor([[float("nan"), 0.0, 0.0], [0.0, 2.0, 0.0]]), rows[:2], [0, 1])
    assert not isinstance(bad[0][0], int) and bad[1][0] == 1


def test_fill_pass_closes_on_a_refusal_a_chunk_or_the_knee_and_fills_without_one():
    def run(remaining, batch_tokens, refuse=()):
        admitted = []

        def admit(c, take):
            if c in refuse:
                return False
            admitted.append(c)
            return True
        out = fill_pass(list(remaining), PassBudget(100, batch_tokens), remaining.get, admit)
        assert [c for c, _ in out] == admitted
        return out

    assert run({"a": 10, "b": 20, "c": 200}, 64) == [("a", 10), ("b", 20)]   # c does not fit whole
    assert run({"a": 10, "b": 20, "c": 5}, 64, refuse={"b"}) == [("a", 10)]   # nobody overtakes b
    assert run({"a": 150, "b": 5}, 64) == [("a", 100)]                          # chunked: the pass is full
    assert run({"a": 30, "b": 50, "c": 40}, None) == [("a", 30), ("b", 50), ("c", 20)]   # filled, c chunked


def test_prefix_caching_refuses_a_rope_whose_rotation_depends_on_the_length(model):
    long = _model(config=replace(TINY, rope_scaling=RopeScaling("dynamic", 2.0, 64)))
    pool = KVPool(TINY, CacheConfig(block_size=BS, num_blocks=2))
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        ModelRunner(long, pool, prefix_caching=True)
    assert not ModelRunner(long, pool).prefix_caching
    assert _runner(model).prefix_caching   # default rope: fine


def test_the_pool_must_fit_the_model_and_the_registry_names_its_families(model):
    assert model.kv_layers() == [LayerKV(2, 8)] * 2
    check_pool(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=2)))
    other = ModelConfig(**{**TINY.__dict__, "num_kv_heads": 4})
    with pytest.raises(ValueError, match="does not fit"):
        check_pool(model, KVPool(other, CacheConfig(block_size=BS, num_blocks=2)))
    with pytest.raises(ValueError, match="dtype"):
        check_pool(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=2, dtype="bfloat16")))
    assert model_class("llama") is LlamaModel and "llama" in ARCHITECTURES
    with pytest.raises(ModelLoadError, match="'gpt2'"):
        model_class("gpt2")


def test_short_passes_run_on_one_thread_and_long_ones_on_all(model):
    """``parallel_min_tokens``: a pass of fewer tokens (a decode step) runs on one torch thread, a
    longer one (a prompt chunk) on the threads the process had when the runner was built; the
    logits do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = ModelRunner(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=32)), False,
                             parallel_min_tokens=8)
        seen = []
        long_seq, short_seq = _Seq(list(range(1, 9))), _Seq(list(range(1, 8)))
        for seq in (long_seq, short_seq):
            assert runner.grow(seq, len(seq.prompt_token_ids))
            chunk = SeqChunk(seq.prompt_token_ids, 0, seq.block_table)
            runner.execute([(seq, chunk)], on_layer_done=lambda i: seen.append(torch.get_num_threads()))
        assert seen == [2] * TINY.num_layers + [1] * TINY.num_layers
        torch.set_num_threads(2)
        everything = ModelRunner(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=32)), False)
        assert everything.set_pass_threads(1) == 2
        with pytest.raises(ValueError, match="parallel_min_tokens"):
            ModelRunner(model, KVPool(TINY, CacheConfig(block_size=BS, num_blocks=32)), parallel_min_tokens=-1)
    finally:
        torch.set_num_threads(before)
