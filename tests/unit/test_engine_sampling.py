"""Sampling parameters and the sampler: pure logic."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import (Row, SamplingError, SamplingParams, compute_logprobs, draw_seed, process_logits, sample,
                             warp_logits)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": tuple("abcdefghijklmnopq")}, "stop"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
])
def test_invalid_params_raise(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def _rows(params, n=1, gen=None, prompt=(1, 2, 3), output=(), stops=frozenset()):
    params = params if isinstance(params, list) else [params] * n
    return [Row(p, gen if gen is not None else p.make_generator(), list(prompt), list(output), stops)
            for p in params]


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert sample(logits, _rows(SamplingParams(temperature=0), 3)) == logits.argmax(-1).tolist()


def test_seed_reproducible_and_top_k_one_is_greedy():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits, _rows(p))[0] for _ in range(3)]
    assert len(set(a)) == 1
    k1 = SamplingParams(temperature=1.5, top_k=1, seed=1)
    assert sample(logits, _rows(k1)) == logits.argmax(-1).tolist()


def test_seeded_draws_depend_on_seed_and_output_index_only():
    """Draw i of a seeded request is the same wherever it happens: a fresh generator at output
    index i (the decode worker), one that already drew (the single process), or a resumed
    attempt whose earlier output sits at the end of its prompt (num_resumed)."""
    logits = torch.zeros(1, 1000)   # uniform: each draw is the generator's alone
    p = SamplingParams(temperature=1.0, seed=1234)
    gen = p.make_generator()
    history: list[int] = []
    for _ in range(6):   # the single process: one generator, the output growing
        history.append(sample(logits, [Row(p, gen, [5, 6], list(history))])[0])
    assert len(set(history)) > 1
    for i in range(6):
        fresh = sample(logits, [Row(p, p.make_generator(), [5, 6], history[:i])])[0]
        resumed = SamplingParams(temperature=1.0, seed=1234, num_resumed=i)
        moved = sample(logits, [Row(resumed, resumed.make_generator(), [5, 6, *history[:i]], [])])[0]
        assert fresh == moved == history[i]
    other = SamplingParams(temperature=1.0, seed=1235)
    assert [sample(logits, [Row(other, None, [5, 6], history[:i])])[0] for i in range(6)] != history
    assert draw_seed(0, 0) != draw_seed(0, 1) != draw_seed(1, 0) and 0 <= draw_seed(2**63 - 1, 10**9) < 2**63


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0, -10.0]])
    p = SamplingParams(temperature=1.0, top_p=0.5)
    gen = _seeded(3)
    assert {sample(logits, _rows(p, gen=gen))[0] for _ in range(50)} == {0}
    p = SamplingParams(temperature=1.0, top_p=0.99)
    assert {sample(logits, _rows(p, gen=gen))[0] for _ in range(200)} == {0, 1}


def test_min_p_drops_exactly_the_tokens_below_min_p_times_the_top_probability():
    """vLLM's min_p: keep p_i >= min_p * max p, on the distribution after the temperature."""
    logits = torch.log(torch.tensor([0.5, 0.2, 0.126, 0.124, 0.05]))
    kept = warp_logits(logits, SamplingParams(temperature=1.0, min_p=0.25)).isfinite().tolist()
    assert kept == [True, True, True, False, False]          # threshold 0.125
    flat = warp_logits(logits, SamplingParams(temperature=2.0, min_p=0.25))
    assert flat.isfinite().all()   # at temperature 2 every p_i / p_max >= sqrt(0.05 / 0.5) > 0.25
    assert torch.equal(warp_logits(logits, SamplingParams(temperature=1.0, min_p=0.0)), logits)
    assert warp_logits(logits, SamplingParams(temperature=1.0, min_p=1.0)).isfinite().tolist() == [True] + [False] * 4
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(4096, generator=gen) * 3
    probs = big.double().softmax(-1)
    want = (probs >= 0.05 * probs.max()).tolist()
    p = SamplingParams(temperature=1.0, min_p=0.05)
    assert warp_logits(big, p).isfinite().tolist() == want and 1 < sum(want) < 4096
    picks = {sample(big[None], _rows(p, gen=gen))[0] for _ in range(300)}
    assert all(want[t] for t in picks) and len(picks) > 1


def test_min_p_leaves_batch_mates_and_greedy_rows_alone():
    """The same logits row for three requests: the min_p row picks only from its kept set, its
    seeded batch-mate draws exactly what it draws beside a plain request (tokens min_p would drop
    included), and a greedy row with min_p is the argmax."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(11)).expand(3, 1000).contiguous()
    probs = logits[0].softmax(-1)
    kept = set((probs >= 0.2 * probs.max()).nonzero()[:, 0].tolist())
    mate_alone, mate_mixed, filtered = [], [], []
    for seed in range(150):
        mate = SamplingParams(temperature=1.0, seed=seed)
        picky = SamplingParams(temperature=1.0, seed=seed + 1000, min_p=0.2)
        greedy = SamplingParams(temperature=0.0, min_p=0.9)
        alone = sample(logits, _rows([mate, SamplingParams(temperature=1.0, seed=seed + 1000), greedy]))
        mixed = sample(logits, _rows([mate, picky, greedy]))
        mate_alone.append(alone[0])
        mate_mixed.append(mixed[0])
        filtered.append(mixed[1])
        assert alone[2] == mixed[2] == int(logits[0].argmax())
    assert mate_alone == mate_mixed
    assert set(filtered) <= kept and len(set(filtered)) > 1
    assert any(t not in kept for t in mate_mixed)   # the batch-mate still draws outside min_p's set


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0)
    gen = _seeded(7)
    draws = torch.tensor([sample(logits, _rows(p, gen=gen))[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_inverse_cdf_draw_over_a_full_vocabulary_never_picks_masked_tokens():
    """`draw` (inverse transform sampling) on a 49152-token vocabulary where only every 7th
    token may be picked: no masked token ever comes out, even for u at the interval edges, and
    the frequencies follow the distribution."""
    from engine.sampling import draw

    vocab = 49152
    gen = torch.Generator().manual_seed(3)
    logits = torch.full((vocab,), float("-inf"))
    allowed = torch.arange(0, vocab, 7)
    logits[allowed] = torch.randn(allowed.numel(), generator=gen) * 2
    probs = logits.softmax(-1)
    cdf = probs.cumsum(-1)
    total = float(cdf[-1])
    edges = [0.0, float(cdf[allowed[5]]), float(cdf[allowed[5] + 1]), total * (1 - 2**-24)]
    picks = [draw(cdf, torch.tensor([u])) for u in edges]
    picks += [draw(cdf, torch.rand(1, generator=gen) * total) for _ in range(20000)]
    assert all(t % 7 == 0 for t in picks), [t for t in picks if t % 7][:5]
    top = int(probs.argmax())
    freq = sum(t == top for t in picks) / len(picks)
    assert abs(freq - float(probs[top])) < 0.02, (freq, float(probs[top]))


def test_a_row_with_nan_or_inf_fails_alone_and_masked_tokens_are_fine():
    logits = torch.randn(5, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :10] = float("-inf")   # masked tokens: still a valid row
    expected = logits[4].argmax().item()
    for temperature in (0.0, 0.7):
        out = sample(logits, _rows(SamplingParams(temperature=temperature, seed=1), 5))
        assert all(isinstance(out[r], SamplingError) for r in (1, 2, 3))
        assert isinstance(out[0], int) and isinstance(out[4], int) and out[4] >= 10
        if temperature == 0.0:
            assert out[0] == logits[0].argmax().item() and out[4] == expected


@pytest.mark.parametrize("kwargs, match", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"num_resumed": -1}, "num_resumed"),
])
def test_invalid_processor_params_raise(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_penalties_match_transformers_and_openai_definitions():
    """repetition_penalty equals Hugging Face's RepetitionPenaltyLogitsProcessor over prompt +
    output; frequency/presence follow OpenAI's formula over the output alone (a resumed
    request's output counted from the end of its prompt)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(64) * 3
    prompt, output = [1, 2, 2, 9], [9, 9, 30, 2]
    rep = SamplingParams(repetition_penalty=1.3)
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(process_logits(logits, Row(rep, None, prompt, output)), want)
    pen = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, num_resumed=2)
    got = process_logits(logits, Row(pen, None, prompt + output[:2], output[2:]))
    counts = torch.bincount(torch.tensor(output), minlength=64).float()
    assert torch.allclose(got, logits - 0.25 * counts - 0.5 * (counts > 0))
    assert got[1] == logits[1]   # in the prompt only: no OpenAI penalty


def test_logit_bias_and_min_tokens_steer_greedy_choice_and_leave_batch_mates_alone():
    logits = torch.randn(3, 50)
    plain = SamplingParams(temperature=0)
    biased = SamplingParams(temperature=0, logit_bias=((7, 100.0),))
    stop = int(logits[2].argmax())
    blocked = SamplingParams(temperature=0, min_tokens=2)
    rows = [Row(plain, None, [1]), Row(biased, None, [1]), Row(blocked, None, [1], [4], frozenset({stop}))]
    out = sample(logits, rows)
    assert out[0] == int(logits[0].argmax()) and out[1] == 7
    assert out[2] != stop and out[2] == int(logits[2].topk(2).indices[1])
    rows[2] = Row(blocked, None, [1], [4, 4], frozenset({stop}))   # min_tokens reached
    assert sample(logits, rows)[2] == stop
    only_stop = torch.full((1, 50), float("-inf"))
    only_stop[0, stop] = 0.0
    assert isinstance(sample(only_stop, [Row(blocked, None, [1], [], frozenset({stop}))])[0], SamplingError)


def test_logprobs_are_log_softmax_of_the_raw_logits_with_the_top_k():
    logits = torch.randn(3, 40)
    want = torch.log_softmax(logits, -1)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, logprobs=0, presence_penalty=1.0)]
    rows = _rows(params, output=[5])
    tokens = sample(logits, rows)
    out = compute_logprobs(logits, rows, tokens)
    assert out[1] is None
    assert out[0].token_id == tokens[0] and abs(out[0].logprob - want[0, tokens[0]].item()) < 1e-6
    top = want[0].topk(3)
    assert [t for t, _ in out[0].top] == top.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in out[0].top]), top.values)
    assert out[2].top == () and abs(out[2].logprob - want[2, tokens[2]].item()) < 1e-6


def test_rows_drawn_together_follow_each_rows_tempered_distribution_and_skip_masked_tokens():
    """`draw_rows` over a vocabulary that is not a whole number of chunks (49157 = 192 x 256 +
    5), where only every 7th token may be picked: u at 0, at a chunk's edge and just below 1
    never gives a masked token; each row's frequencies follow softmax(logits / its temperature)
    (a row drawn at the wrong temperature, or a chunk offset off by one, fails)."""
    from engine.draw import DRAW_CHUNK, draw_rows

    vocab, draws = 49157, 6000
    gen = torch.Generator().manual_seed(11)
    logits = torch.full((2, vocab), float("-inf"))
    allowed = torch.arange(0, vocab, 7)
    logits[:, allowed] = torch.randn(2, allowed.numel(), generator=gen)
    likely = allowed[[0, 1000, 5000, -1]]   # inside chunks 0, 27 and 136, and the last token
    logits[:, likely] += torch.tensor([6.0, 6.0, 5.5, 5.0])
    temperatures = torch.tensor([1.0, 0.5])
    best = logits.amax(-1)
    probs = (logits / temperatures[:, None]).softmax(-1)
    running = probs.cumsum(-1)
    edge = float(running[0, DRAW_CHUNK - 1]) / float(running[0, -1])
    for u in (0.0, edge, 1 - 2**-24):
        tokens = draw_rows(logits, best, temperatures, torch.tensor([u, u]))
        assert all(t % 7 == 0 for t in tokens.tolist()), tokens
    tail_masked = logits.clone()
    tail_masked[:, -3 * DRAW_CHUNK:] = float("-inf")   # u * total rounding up must not land there
    tokens = draw_rows(tail_masked, best, temperatures, torch.tensor([1.0, 1.0]))
    assert all(t % 7 == 0 and t < vocab - 3 * DRAW_CHUNK for t in tokens.tolist()), tokens
    picks = torch.stack([draw_rows(logits, best, temperatures, torch.rand(2, generator=gen)) for _ in range(draws)])
    assert bool((picks % 7 == 0).all())
    for r in range(2):
        freq = torch.bincount(picks[:, r], minlength=vocab).float() / draws
        for token in likely.tolist():
            assert abs(float(freq[token]) - float(probs[r, token])) < 0.025, (r, token, float(freq[token]),
                                                                                 float(probs[r, token]))


def test_sample_draws_plain_rows_together_from_their_own_generators_and_leaves_the_others_alone():
    """A batch of greedy, seeded, top-k, NaN and `DRAW_ROWS_MIN` plain temperature rows: the
    plain rows' tokens are `draw_rows`' over their own logits, temperatures and generators' next
    numbers; the other rows are what each alone gives. Fewer plain rows are drawn one at a time."""
    from engine.draw import DRAW_ROWS_MIN, draw_rows
    from engine.sampling import plain_temperature

    gen = torch.Generator().manual_seed(5)
    temps = [0.5 + 0.1 * i for i in range(DRAW_ROWS_MIN)]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=4),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.9), SamplingParams(temperature=0)]
    params += [SamplingParams(temperature=t) for t in temps]
    logits = torch.randn(len(params), 300, generator=gen) * 3
    logits[3, 9] = float("nan")
    assert [plain_temperature(p) for p in params] == [False, False, False, True, False] + [True] * DRAW_ROWS_MIN
    rows = [Row(p, _seeded(100 + i) if not p.greedy else None, [1, 2, 3]) for i, p in enumerate(params)]
    out = sample(logits, rows)
    plain = torch.arange(5, len(params))
    u = torch.cat([torch.rand(1, generator=_seeded(100 + r)) for r in plain.tolist()])
    assert out[5:] == draw_rows(logits[plain], logits[plain].amax(-1), torch.tensor(temps), u).tolist()
    assert [out[0], out[2], out[4]] == logits[[0, 2, 4]].argmax(-1).tolist()
    assert out[1] == sample(logits[1:2], [Row(params[1], _seeded(101), [1, 2, 3])])[0]
    assert isinstance(out[3], SamplingError)
    few = [Row(SamplingParams(temperature=1.0), _seeded(7), [1]) for _ in range(2)]
    alone = [Row(SamplingParams(temperature=1.0), _seeded(7), [1])]
    assert sample(logits[5:7], few)[0] == sample(logits[5:6], alone)[0]   # one at a time, as alone
