"""A ``tokenizers.Tokenizer`` from a GGUF file's vocabulary (``tokenizer.ggml.*``), as llama.cpp reads it.

A GGUF stores no ``tokenizer.json``: only the tokens, their types and scores, the merges, and two
names that pick code compiled into llama.cpp (source: llama.cpp ``src/llama-vocab.cpp``):

- ``tokenizer.ggml.model``: ``"gpt2"`` is byte-level BPE (LLAMA_VOCAB_TYPE_BPE), ``"llama"`` is
  SentencePiece BPE (LLAMA_VOCAB_TYPE_SPM: ``▁`` for spaces, ``<0xNN>`` byte fallback, pieces
  merged by score). Other models (``t5``, ``bert``, ``rwkv``, ``plamo2``, ...) are refused.
- ``tokenizer.ggml.pre`` (BPE only): the pre-tokenizer, a list of regexes applied one after the
  other, each keeping matches and gaps as separate pieces (``llm_tokenizer_bpe``'s
  ``regex_exprs`` per LLAMA_VOCAB_PRE_TYPE_*, and the name -> type table of
  ``llama_vocab::impl::load``). Built the way the models' own ``tokenizer.json`` files do:
  ``Sequence([Split(regex, "isolated"), ..., ByteLevel(use_regex=False)])``. A missing name is
  llama.cpp's ``default``; an unknown one raises `TokenizerError`.

SentencePiece vocabularies follow llama.cpp's ``llm_tokenizer_spm``: a space is prefixed to each run
of text (``tokenizer.ggml.add_space_prefix``, default true, as the original Llama 2
``tokenizer.json``'s ``Prepend`` normalizer does), spaces become ``▁``, and pieces merge best score
first; the merges come from the file or are derived from the scores as transformers'
``generate_merges`` does. Gemma files get transformers' two fixes (``integrations/gguf/
gguf_tokenizer_mapping.py`` ``gemma_tokenizer``): multi-space tokens respelled with ``▁`` and merges
ranked by file position. Only ``tokenizers`` and ``gguf`` are imported (the router loads this).
"""

from __future__ import annotations

import dataclasses

from engine.errors import TokenizerError

# llama.cpp regex_exprs (src/llama-vocab.cpp); where llama.cpp hand-rewrites a tokenizer.json regex,
# the original (quoted in its comment, and in transformers' GGUF_PRE_TOKENIZER_SPLITS) is used.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class PreType:
    """One LLAMA_VOCAB_PRE_TYPE_*: its regexes, and the flags llama_vocab::load sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token is not merged (llama3, tekken)
    add_bos: bool = False        # llama.cpp's default when the file has no add_bos_token


_DEFAULT = PreType((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_TYPE = PreType((_GPT2,))
_DIGITS_GPT2 = PreType((r"\p{N}", _GPT2))
_LLAMA3_TYPE = PreType((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_TYPE = PreType((_QWEN2,))
_GPT4O_TYPE = PreType((_GPT4O,))
_FALCON = PreType((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))

# tokenizer.ggml.pre -> type, as llama_vocab::impl::load maps them.
PRE_TYPES: dict[str, PreType] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "mpt", "olmo", "jais", "exaone4", "trillion"), _GPT2_TYPE),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    _DIGITS_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3_TYPE),
    # DBRX and SMAUG share Llama 3's regex but not its ignore_merges / add_bos flags.
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreType((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan"), _QWEN2_TYPE),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_TYPE),
    "tekken": PreType((_TEKKEN,), ignore_merges=True, add_bos=True),
    "falcon": _FALCON,
}

_SENTENCEPIECE_BOS_DEFAULT = True  # llama_vocab::load: SPM vocabularies add BOS unless the file says not
_GEMMA = {"gemma", "gemma2", "gemma3"}


@dataclasses.dataclass
class GGUFVocab:
    """What `build` reads: the backend and the BOS flag llama.cpp would use."""

    backend: object
    add_bos: bool


def build(get, architecture: str) -> GGUFVocab:
    """The tokenizer a GGUF's metadata describes. ``get(key, default)`` reads one field.

    Raises `TokenizerError` naming the field for a tokenizer model or pre-tokenizer not built here."""
    kind = get("tokenizer.ggml.model", None)
    if kind == "gpt2":
        backend, add_bos = _byte_level(get)
    elif kind == "llama":
        backend, add_bos = _sentencepiece(get, architecture), _SENTENCEPIECE_BOS_DEFAULT
    else:
        raise TokenizerError(f"tokenizer.ggml.model = {kind!r} is not supported "
                             "(byte-level BPE 'gpt2' and SentencePiece BPE 'llama' are)")
    add_bos = bool(get("tokenizer.ggml.add_bos_token", add_bos))
    _add_control_tokens(backend, get("tokenizer.ggml.tokens", []), get("tokenizer.ggml.token_type", None))
    return GGUFVocab(backend, add_bos)


def pre_tokenizer(pre: str | None):
    """The ``tokenizers`` pre-tokenizer for ``tokenizer.ggml.pre`` (None: llama.cpp's default)."""
    from tokenizers import Regex, pre_tokenizers

    kind = _pre_type(pre)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in kind.regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _pre_type(pre: str | None) -> PreType:
    kind = PRE_TYPES.get("default" if pre is None else pre)
    if kind is None:
        raise TokenizerError(f"tokenizer.ggml.pre = {pre!r} is not supported (known: {', '.join(sorted(PRE_TYPES))})")
    return kind


def _byte_level(get):
    from tokenizers import Tokenizer, decoders, models

    pre = get("tokenizer.ggml.pre", None)
    kind = _pre_type(pre)
    tokens = get("tokenizer.ggml.tokens", [])
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=kind.ignore_merges))
    backend.pre_tokenizer = pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend, kind.add_bos


def _sentencepiece(get, architecture: str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = list(get("tokenizer.ggml.tokens", []))
    scores = get("tokenizer.ggml.scores", None)
    if architecture in _GEMMA:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    elif scores is not None:
        rank = dict(zip(tokens, scores))
    elif get("tokenizer.ggml.merges", None) is None:
        raise TokenizerError("tokenizer.ggml.scores is missing, and a SentencePiece vocabulary without "
                             "tokenizer.ggml.merges needs it to rank its merges")
    file_merges = get("tokenizer.ggml.merges", None)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = ([tuple(m.split(" ", 1)) for m in file_merges] if file_merges is not None
              else derive_merges(vocab, rank))
    unk = get("tokenizer.ggml.unknown_token_id", 0)
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                       unk_token=tokens[unk] if 0 <= unk < len(tokens) else None)
    backend = Tokenizer(model)
    prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def derive_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two tokens, best ``rank`` first
    (ties: longer left piece, then longer right piece), as transformers' ``generate_merges``
    (tokenization_utils_base.py) orders them; llama.cpp's SPM merges the best-scored pair the same way."""
    merges = []
    for token, score in rank.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


_CONTROL_TOKEN_TYPES = {3, 4}  # gguf TokenType.CONTROL, USER_DEFINED


def _add_control_tokens(backend, tokens, types) -> None:
    from tokenizers import AddedToken

    types = types or [1] * len(tokens)
    special = [tokens[i] for i, t in enumerate(types) if t in _CONTROL_TOKEN_TYPES]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
