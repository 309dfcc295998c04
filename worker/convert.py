"""Conversions between the protocol's messages and the engine's types."""

from __future__ import annotations

from engine.sampling import SamplingParams, TokenLogprobs
from rpc import pdserve_pb2 as pb


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Engine `SamplingParams` from the wire; raises `InvalidRequestError` on bad values."""
    return SamplingParams(
        max_tokens=int(msg.max_tokens), temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0, top_k=int(msg.top_k),
        min_p=float(msg.min_p), seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=bool(msg.ignore_eos),
        presence_penalty=float(msg.presence_penalty), frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty != 0 else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        min_tokens=int(msg.min_tokens),
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
        grammar=msg.grammar, n=max(1, int(msg.n)), choice=int(msg.choice), num_resumed=int(msg.num_resumed))


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                            top_k=p.top_k, min_p=p.min_p, stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                            repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias),
                            min_tokens=p.min_tokens, grammar=p.grammar, n=p.n, choice=p.choice, num_resumed=p.num_resumed)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top], rank=lp.rank)
