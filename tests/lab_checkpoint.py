"""A small Llama checkpoint for the RDMA lab's cluster tests, written without transformers.

Under the lab's emulated CPU (``rdmalab``: TCG) loading SmolLM2 costs about two minutes per
process and each of its decode steps seconds, while what the lab tests is the data plane: KV
written over verbs, counted by immediates, freed when a writer dies. This checkpoint keeps
that path whole (a Hugging Face directory the engine loads like any model: ``config.json``,
``model.safetensors``, ``tokenizer.json``) at a size that computes in milliseconds:

- tokenizer: byte-level BPE with no merges (one token per UTF-8 byte, the byte's value its id,
  plus ``<|endoftext|>`` as id 256 and end of sequence), built with ``tokenizers``;
- model: Llama, 6 layers, hidden 64, 4 query heads over 2 KV heads of 32 (grouped-query
  attention), SwiGLU 128, untied head; weights from a seeded normal, the embeddings and the head
  scaled up so that the greedy choice has wide margins (a corrupted KV block changes the text).
  The head's rows other than printable ASCII (32-126) are zero: their logit is 0 where the
  printable ones spread several units around it, so greedy text is plain ASCII, which the
  incremental detokenizer and a one-shot decode render alike, and never ends early.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 257          # 256 bytes + <|endoftext|>
EOS = "<|endoftext|>"
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 6, 4, 2, 32, 128


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.tokenizer import _byte_level_alphabet   # GPT-2's bytes_to_unicode, as the engine decodes it

    vocab = _byte_level_alphabet()   # character -> byte: each byte's id is its value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok.to_str()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    out = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0),
           "model.norm.weight": torch.ones(HIDDEN),
           "lm_head.weight": normal(VOCAB, HIDDEN, std=0.5)}
    printable = torch.zeros(VOCAB, 1)
    printable[32:127] = 1.0
    out["lm_head.weight"] *= printable
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": torch.ones(HIDDEN),
                p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN, std=2 * HIDDEN ** -0.5),
                p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=2 * HIDDEN ** -0.5),
                p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=HIDDEN ** -0.5),
                p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, std=(HEADS * HEAD_DIM) ** -0.5),
                p + "mlp.gate_proj.weight": normal(FFN, HIDDEN, std=HIDDEN ** -0.5),
                p + "mlp.up_proj.weight": normal(FFN, HIDDEN, std=HIDDEN ** -0.5),
                p + "mlp.down_proj.weight": normal(HIDDEN, FFN, std=FFN ** -0.5)}
    return out


def write_checkpoint(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint into directory ``out`` (created) and return it.

    Files: ``config.json`` (``LlamaForCausalLM``, float32), ``model.safetensors`` (float32
    tensors named as transformers names them), ``tokenizer.json``, ``tokenizer_config.json``
    (its ``eos_token``). Same ``seed``, same bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
              "bos_token_id": None, "eos_token_id": VOCAB - 1}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer.json").write_text(_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    save_file(_weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
