"""Conversions between the protocol's messages and the engine's types."""

from __future__ import annotations

from engine.sampling import SamplingParams
from rpc import pdserve_pb2 as pb


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Engine `SamplingParams` from the wire; raises `InvalidRequestError` on bad values."""
    return SamplingParams(
        max_tokens=int(msg.max_tokens), temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0, top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=bool(msg.ignore_eos))


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                            top_k=p.top_k, stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    return msg
