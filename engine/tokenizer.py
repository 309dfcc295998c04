"""Tokenizer, chat template and incremental detokenization with stop strings.

Built from GGUF metadata (``tokenizer.ggml.*``: byte-level BPE and SentencePiece vocabularies read
as llama.cpp reads them, `engine.gguf_vocab`) or from a Hugging
Face directory: ``tokenizer.json``, ``tokenizer_config.json``, the chat templates
(`engine.chat_template`: ``chat_template.jinja``, ``additional_chat_templates/``) and
``generation_config.json`` (`engine.generation_config`: stop ids, default sampling). The router
imports this module alone of the engine, so it depends on ``tokenizers`` and ``jinja2`` only (plus
``gguf`` to read metadata).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from engine.chat_template import DEFAULT, ChatTemplate, load_hf_templates, special_token_variables
from engine.errors import ChatTemplateError, InvalidRequestError, TokenizerError
from engine.generation_config import GenerationDefaults, load_generation_config



def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted (GPT-2's ``bytes_to_unicode``:
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _sentencepiece_bytes(piece: str) -> bytes:
    """A SentencePiece piece's bytes: ``<0xNN>`` is one byte, ``▁`` a space (the decoder's
    ``ByteFallback`` and ``Replace``, without its per-call strip of the leading space)."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


@dataclass
class Tokenizer:
    """Text <-> token ids, the chat template and the stop ids the template implies.

    Attributes:
        backend: a ``tokenizers.Tokenizer``.
        eos_token_id: the end-of-sequence id from the model's metadata.
        stop_token_ids: ids that end generation (EOS, the template's end-of-turn token and
            the ids of ``generation_config.json``'s ``eos_token_id``).
        chat_template: Jinja2 source, a dict of named templates (``chat_template`` of transformers'
            tokenizers), or None when the model has none.
        bos_token / eos_token: the model's BOS / EOS strings.
        template_variables: the special tokens the template sees (``bos_token``, ``eos_token``, ...).
        generation_defaults: ``generation_config.json``'s default sampling (empty for a GGUF).
        context_length: the model's context window in tokens, from the same metadata (None when
            the files do not say).
    """

    backend: object
    eos_token_id: int
    stop_token_ids: frozenset[int]
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False
    bos_token_id: int | None = None
    context_length: int | None = None
    template_variables: dict[str, str] = field(default_factory=dict)
    generation_defaults: GenerationDefaults = GenerationDefaults()
    _template: ChatTemplate | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.chat_template is not None:
            named = self.chat_template if isinstance(self.chat_template, dict) else {DEFAULT: self.chat_template}
            self._template = ChatTemplate(named, self.template_variables)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the UTF-8 bytes of text one token covers (the longest token's UTF-8
        form; for byte-level BPE that overestimates, which keeps `min_tokens` a lower bound)."""
        return max((len(t.encode("utf-8")) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(self.encode(text))`` computed without tokenizing (to refuse a
        text that cannot fit the context before paying for its tokenization)."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids.

        Raises `InvalidRequestError` for text that is not valid Unicode (a lone surrogate)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"the text is not valid Unicode: {exc.reason} at position {exc.start}") from exc
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template that renders a request with tools reads ``tools`` itself."""
        try:
            return self._template is not None and "tools" in self._template.select(tools=[])
        except ChatTemplateError:
            return False

    @functools.cached_property
    def _token_bytes(self) -> list[bytes]:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        table = [b""] * self.vocab_size
        byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        byte_fallback = bool(getattr(self.backend.model, "byte_fallback", False))
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        for piece, i in vocab.items():
            if 0 <= i < len(table):
                if byte_level and piece not in added:
                    table[i] = bytes(_UNICODE_TO_BYTE.get(ch, 0) for ch in piece)
                elif byte_fallback and piece not in added:
                    table[i] = _sentencepiece_bytes(piece)
                else:
                    table[i] = self.backend.decode([i], skip_special_tokens=False).encode("utf-8")
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character); special tokens give their text. Raises `IndexError` outside the vocabulary."""
        return self._token_bytes[token_id]

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs: its bytes decoded as UTF-8, an incomplete character
        as U+FFFD (the raw bytes are in `token_bytes`)."""
        return self._token_bytes[token_id].decode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None, documents: Sequence[dict] | None = None,
                            continue_final_message: bool = False, **kwargs) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) as transformers 5's
        ``apply_chat_template(..., tokenize=False)`` does (`engine.chat_template`). ``tools``: JSON
        schemas (OpenAI tool objects), passed as given (None: no tools; a list, even empty, picks
        a "tool_use" template); ``continue_final_message``: end inside the last message (needs
        ``add_generation_prompt`` False); ``kwargs``: extra template variables.

        Raises:
            ChatTemplateError (an InvalidRequestError): no template, or the template rejects or
                fails on the messages.
        """
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        return self._template.render(messages, add_generation_prompt, tools, documents, continue_final_message,
                                     **kwargs)

    def detokenizer(self, stop: Sequence[str] = (), min_tokens: int = 0) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, stop, min_tokens)

    @classmethod
    def from_file(cls, path: str | Path | None = None) -> "Tokenizer":
        """From a ``.gguf`` file or a Hugging Face directory (None: the default model).

        Raises `TokenizerError`, or `ModelLoadError` for a missing path."""
        from engine.modelfile import resolve_model_path

        path = resolve_model_path(path)
        if path.is_dir():
            return _from_hf_dir(path)
        return _from_gguf(path)


def _from_gguf(path: Path) -> Tokenizer:
    from engine import gguf_vocab
    from engine.modelfile import gguf_field, gguf_reader

    reader = gguf_reader(path)
    architecture = gguf_field(reader, "general.architecture", "llama")
    try:
        built = gguf_vocab.build(lambda key, default=None: gguf_field(reader, key, default), architecture)
    except TokenizerError as exc:
        raise TokenizerError(f"{path}: {exc}") from exc
    backend = built.backend
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    eos = int(gguf_field(reader, "tokenizer.ggml.eos_token_id", 0))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    template = gguf_field(reader, "tokenizer.chat_template")
    return Tokenizer(
        backend=backend, eos_token_id=eos,
        stop_token_ids=_stop_ids(vocab, eos, template),
        chat_template=template, bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos], add_bos=built.add_bos,
        template_variables={"bos_token": tokens[bos] if bos is not None else "", "eos_token": tokens[eos]},
        bos_token_id=int(bos) if bos is not None else None,
        context_length=_int_or_none(gguf_field(
            reader, f"{architecture}.context_length")),
    )


def _hf_context(hf: dict) -> int | None:
    """A ``config.json``'s context in tokens: ``max_position_embeddings``, times the rope factor
    for ``dynamic`` scaling, as the engine serves it (`engine.models.hf_config._context`; read here
    without importing torch)."""
    context = hf.get("max_position_embeddings")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if context and kind == "dynamic" and "factor" in rope:
        return int(int(context) * float(rope["factor"]))
    return context


def _int_or_none(value) -> int | None:
    return int(value) if value else None


def _stop_ids(vocab: dict[str, int], eos: int, template: str | dict[str, str] | None) -> frozenset[int]:
    ids = {eos}
    text = "\n".join(template.values()) if isinstance(template, dict) else template
    for end_of_turn in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if end_of_turn in vocab and (text is None or end_of_turn in text):
            ids.add(vocab[end_of_turn])
    return frozenset(ids)


def _from_hf_dir(path: Path) -> Tokenizer:
    """Raises `TokenizerError` (missing or malformed tokenizer files, a template that does not
    parse) or `ModelLoadError` (a malformed ``generation_config.json``)."""
    from tokenizers import Tokenizer as HFTokenizer

    file = path / "tokenizer.json"
    if not file.exists():
        raise TokenizerError(f"{path}: no tokenizer.json")
    backend = HFTokenizer.from_file(str(file))
    config = {}
    if (path / "tokenizer_config.json").exists():
        config = json.loads((path / "tokenizer_config.json").read_text())

    def token_text(value):
        return value.get("content") if isinstance(value, dict) else value

    eos_token = token_text(config.get("eos_token")) or "</s>"
    bos_token = token_text(config.get("bos_token")) or ""
    vocab = backend.get_vocab(with_added_tokens=True)
    if eos_token not in vocab:
        raise TokenizerError(f"{path}: eos token {eos_token!r} not in the vocabulary")
    named = load_hf_templates(path, config)
    template = named.get(DEFAULT) if set(named) == {DEFAULT} else (named or None)
    model_config = path / "config.json"
    context = _hf_context(json.loads(model_config.read_text())) if model_config.exists() else None
    defaults = load_generation_config(path)
    out_of_vocab = [t for t in defaults.eos_token_ids if t >= backend.get_vocab_size(with_added_tokens=True)]
    if out_of_vocab:
        raise TokenizerError(f"{path}: generation_config.json eos_token_id {out_of_vocab} outside the vocabulary")
    return Tokenizer(backend=backend, eos_token_id=vocab[eos_token],
                     stop_token_ids=_stop_ids(vocab, vocab[eos_token], template) | set(defaults.eos_token_ids),
                     chat_template=template, bos_token=bos_token, eos_token=eos_token,
                     add_bos=False, bos_token_id=vocab.get(bos_token), context_length=_int_or_none(context),
                     template_variables=special_token_variables(config), generation_defaults=defaults)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, and finds stop strings.

    Each token decodes only a short window (the tokens since the last emitted text boundary), so
    the cost per token does not grow with the output (method after vLLM's incremental
    detokenizer: a prefix offset and a read offset). Incomplete UTF-8 sequences (the decoder
    yields U+FFFD) wait for the next token. Text that could still be the start of a stop string is
    held back until it cannot be, so a streamed client never sees characters that are later cut.
    Stop strings are looked for only once ``min_tokens`` tokens were added, in the text from
    then on (vLLM's ``min_tokens`` semantics).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0):
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0        # window start: tokens before it are fully in ``text``
        self._read = 0          # tokens up to here are in ``text``
        self.text = ""          # all text decoded so far (truncated at a stop string)
        self._emitted = 0       # characters of ``text`` already returned
        self.stopped_by: str | None = None
        self._min_tokens = min_tokens
        self._search_from = 0   # text before it can no longer hold a stop string (min_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the new text safe to show (possibly empty)."""
        if self.stopped_by is not None:
            return ""
        self._ids.append(int(token_id))
        window = self._tok.decode(self._ids[self._prefix:])
        if window.endswith("\ufffd"):
            return ""
        known = self._tok.decode(self._ids[self._prefix:self._read])
        search_from = max(0, len(self.text) - self._hold)
        self.text += window[len(known):]
        self._prefix, self._read = self._read, len(self._ids)
        if len(self._ids) < self._min_tokens:
            self._search_from = len(self.text)
        search_from = max(search_from, self._search_from)
        for s in self._stop:
            at = self.text.find(s, search_from)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped_by = s
                return self._take(len(self.text))
        return self._take(len(self.text) - self._hold if self._stop else len(self.text))

    def flush(self) -> str:
        """The held-back remainder at the end of generation (with any incomplete UTF-8 tail
        decoded as U+FFFD, as a full decode would)."""
        if self.stopped_by is None and self._read < len(self._ids):
            window = self._tok.decode(self._ids[self._prefix:])
            self.text += window[len(self._tok.decode(self._ids[self._prefix:self._read])):]
            self._read = len(self._ids)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted:upto]
        self._emitted = upto
        return delta
