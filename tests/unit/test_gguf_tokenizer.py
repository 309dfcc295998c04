"""GGUF tokenizers read as llama.cpp reads them (`engine.gguf_vocab`), checked against transformers'
own GGUF conversion (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) on GGUF files that carry
tokenizer metadata only: SmolLM2's byte-level vocabulary under each ``tokenizer.ggml.pre`` family,
and a small synthetic SentencePiece vocabulary."""

from __future__ import annotations

import pytest

from engine.errors import TokenizerError
from engine.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TEXTS = ["12345 678", "I'M HERE, you're", "a\n\n\nb\r\n", "  spaces   ", "emoji 🤖 and 日本語",
         "def f(x):\n\tif x:\n\t\treturn 'ok'  # done\n"]


VOCAB_SIZE = 4096   # SmolLM2's first tokens: its specials, the 256 bytes and its first merges


@pytest.fixture(scope="module")
def smollm_vocab():
    """SmolLM2's byte-level vocabulary cut to its first ``VOCAB_SIZE`` tokens and the merges
    among them (its ids follow merge rank): every text still tokenizes (byte fallback of the
    byte-level alphabet), and each file here costs transformers' converter and gguf-py a tenth of
    the full vocabulary's time."""
    from engine.modelfile import default_model_path, gguf_field, gguf_reader

    reader = gguf_reader(default_model_path())
    vocab = {key: gguf_field(reader, f"tokenizer.ggml.{key}")
             for key in ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id")}
    tokens = list(vocab["tokens"][:VOCAB_SIZE])
    kept = set(tokens)
    merges = [m for m in vocab["merges"] if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    assert len(merges) > VOCAB_SIZE // 2 and vocab["eos_token_id"] < VOCAB_SIZE
    return {**vocab, "tokens": tokens, "token_type": list(vocab["token_type"][:VOCAB_SIZE]), "merges": merges}


def _write(path, arch, model, tokens, types, pre=None, merges=None, scores=None, bos=1, eos=2,
           add_bos=None, add_space_prefix=None):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bpe_file(tmp_path, vocab, pre):
    name = f"bpe-{pre}.gguf"
    return _write(tmp_path / name, "llama", "gpt2", vocab["tokens"], vocab["token_type"], pre=pre,
                  merges=vocab["merges"], bos=vocab["bos_token_id"], eos=vocab["eos_token_id"], add_bos=False)


def _reference(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("pre, same_as", [("gpt-2", None), ("mpt", "gpt-2"), ("llama-bpe", None),
                                           ("smaug-bpe", None), ("dbrx", None), ("qwen2", None),
                                           ("stablelm2", "qwen2"), ("gpt-4o", None)])
def test_byte_level_matches_transformers(tmp_path, smollm_vocab, pre, same_as):
    """``same_as``: a name transformers' converter does not map, compared with the one llama.cpp
    gives the same regex (LLAMA_VOCAB_PRE_TYPE_STABLELM2 shares QWEN2's, MPT shares GPT2's)."""
    path = _bpe_file(tmp_path, smollm_vocab, pre)
    ours, ref = Tokenizer.from_file(path), _reference(_bpe_file(tmp_path, smollm_vocab, same_as or pre))
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ours.encode(text)) == text


def test_smollm_splits_digits_like_its_tokenizer_json(tmp_path, smollm_vocab):
    """transformers' GGUF converter has no digit split for "smollm"; SmolLM2's tokenizer.json and
    llama.cpp (LLAMA_VOCAB_PRE_TYPE_SMOLLM: ``\\p{N}`` first) split digits one by one."""
    from tokenizers import pre_tokenizers

    path = _bpe_file(tmp_path, smollm_vocab, "smollm")
    ours, ref = Tokenizer.from_file(path), _reference(path).backend_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    assert len(ours.encode("12345")) == 5


def test_default_pre_is_llama_cpps_default(tmp_path, smollm_vocab):
    """No tokenizer.ggml.pre: llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT regexes (punctuation runs,
    the GPT-2 regex, digit runs, then groups of three digits)."""
    path = _bpe_file(tmp_path, smollm_vocab, None)
    pieces = [p for p, _ in Tokenizer.from_file(path).backend.pre_tokenizer.pre_tokenize_str("x=12345, y")]
    assert pieces == ["x", "=", "123", "45", ",", "Ġy"]


def test_old_gpt2_regex_for_llama_bpe_differs(tmp_path, smollm_vocab):
    """The former fallback (GPT-2's byte-level regex for any unknown pre) tokenizes Llama 3 files
    differently from their training split, so the comparison above can fail."""
    from tokenizers import pre_tokenizers

    path = _bpe_file(tmp_path, smollm_vocab, "llama-bpe")
    ours, ref = Tokenizer.from_file(path), _reference(path)
    old = Tokenizer.from_file(path).backend
    old.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    differ = [t for t in TEXTS if old.encode(t, add_special_tokens=False).ids != ours.encode(t)]
    assert differ and all(ours.encode(t) == ref.encode(t, add_special_tokens=False) for t in differ)


def test_unknown_pre_is_refused(tmp_path, smollm_vocab):
    path = _bpe_file(tmp_path, smollm_vocab, "no-such-pre")
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.pre = 'no-such-pre'"):
        Tokenizer.from_file(path)


def test_unknown_model_is_refused(tmp_path):
    path = _write(tmp_path / "t5.gguf", "t5", "t5", ["<pad>", "<s>", "</s>"], [3, 3, 3], scores=[0.0] * 3)
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model = 't5'"):
        Tokenizer.from_file(path)


def _spm_vocab():
    """A small SentencePiece vocabulary: specials, 256 byte tokens, characters and merged pieces,
    scored best-first like a SentencePiece BPE model."""
    pieces = ["▁", "e", "a", "s", "p", "c", "r", "o", "n", "d", "i", "m", "j", "y", "u", "t", "H", "I", "M", "R",
              "E", "'", ",", "1", "2", "3", "4", "5", "6", "7", "8", "f", "x", "(", ")", ":", "k", "#", "b", "l",
              "h", "w", "本", "日", "▁▁", "▁a", "▁s", "es", "ac", "sp", "pa", "▁sp", "ace", "aces", "▁spaces",
              "12", "123", "▁6", "▁67", "re", "'re", "ou", "you", "▁you", "▁I", "▁H", "ER", "ERE", "▁an", "▁and",
              "ji", "oji", "emoji", "▁emoji", "de", "▁de", "▁def", "if", "▁if", "ur", "urn", "return", "one",
              "▁d", "日本", "▁▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


@pytest.mark.parametrize("arch", ["phi3", "llama"])
def test_sentencepiece_matches_transformers(tmp_path, arch):
    tokens, types, scores = _spm_vocab()
    path = _write(tmp_path / f"spm-{arch}.gguf", arch, "llama", tokens, types, scores=scores)
    ours, ref = Tokenizer.from_file(path), _reference(path)
    assert ours.add_bos and ours.encode("a")[0] == 1
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=False)
        if arch == "llama" and text.startswith(" "):
            # transformers' LlamaTokenizer (Metaspace) adds no prefix space before a leading space;
            # llama.cpp's llm_tokenizer_spm and Llama 2's tokenizer.json (Prepend) always add one.
            expected = _reference(_write(tmp_path / "spm-phi3.gguf", "phi3", "llama", tokens, types,
                                         scores=scores)).encode(text, add_special_tokens=False)
        assert ours.encode(text)[1:] == expected, (arch, text)
        assert ours.decode(ours.encode(text)) == text


def test_sentencepiece_token_bytes(tmp_path):
    tokens, types, scores = _spm_vocab()
    ours = Tokenizer.from_file(_write(tmp_path / "spm.gguf", "llama", "llama", tokens, types, scores=scores,
                                      add_bos=False))
    assert not ours.add_bos
    assert ours.token_bytes(tokens.index("▁spaces")) == b" spaces"
    assert ours.token_bytes(tokens.index("<0x0A>")) == b"\n"


def test_sentencepiece_without_prefix_space(tmp_path):
    tokens, types, scores = _spm_vocab()
    path = _write(tmp_path / "spm.gguf", "llama", "llama", tokens, types, scores=scores, add_space_prefix=False)
    ours = Tokenizer.from_file(path)
    assert ours.encode("spaces")[1:] == [tokens.index("sp"), tokens.index("aces")]
    assert ours.decode(ours.encode(" you")) == " you"
