"""GGUF K-quants, Q8_0, Q4_0 and Q4_1 as the GGUF loader reads them (`engine.gguf_weights`): each
tensor of a written file decodes to what the ``gguf`` package (llama.cpp's Python reference)
dequantizes from the same blocks, bit for bit (Q8_0 / Q4_0 / Q4_1 are decoded by torch there);
in native mode Q4_0 / Q4_1 / Q4_K stay 4-bit (their decoding against gguf's:
tests/unit/test_engine_quant.py) and the other types are dequantized."""

from __future__ import annotations

import numpy as np
import pytest

from engine.gguf_weights import _GGUFTensors
from engine.modelfile import gguf_reader
from engine.quant import Int4Weight

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# type -> byte offsets of its float16 scales in a block (ggml-common.h: block_q4_K d, dmin;
# block_q5_K d, dmin; block_q6_K d after ql[128], qh[64], scales[16]; block_q8_0 d; block_q4_0
# d; block_q4_1 d, m)
SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2)}


def _random_blocks(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    """``[rows, bytes_per_row]`` uint8: random codes, finite random float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in SCALES[kind]:
        scale = rng.uniform(0.001, 0.02, size=data.shape[:2]).astype(np.float16)
        data[..., at:at + 2] = scale[..., None].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("quants") / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    blocks = {}
    for i, kind in enumerate(SCALES):
        blocks[kind.name] = _random_blocks(kind, 16, 512, seed=i)
        w.add_tensor(f"{kind.name}.weight", blocks[kind.name], raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, blocks


@pytest.mark.parametrize("kind", list(SCALES), ids=lambda k: k.name)
def test_the_loader_dequantizes_like_the_gguf_package(quantized_file, kind):
    path, blocks = quantized_file
    got = _GGUFTensors(gguf_reader(path), path, native=False).take(f"{kind.name}.weight", native=True)
    want = gguf.quants.dequantize(blocks[kind.name], kind)
    assert got.shape == (16, 512) and np.isfinite(want).all()
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("kind", list(SCALES), ids=lambda k: k.name)
def test_native_mode_keeps_q4_k_and_dequantizes_the_rest(quantized_file, kind):
    path, blocks = quantized_file
    got = _GGUFTensors(gguf_reader(path), path, native=True).take(f"{kind.name}.weight", native=True)
    want = gguf.quants.dequantize(blocks[kind.name], kind)
    if kind in (T.Q4_K, T.Q4_0, T.Q4_1):
        assert isinstance(got, Int4Weight)
        np.testing.assert_allclose(got.dequantize().numpy(), want, rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(got, want)


def test_the_cached_reader_reads_every_field_and_tensor_as_the_gguf_package_does():
    """`engine.modelfile.gguf_reader` holds the file map as a plain ndarray view (fast slicing);
    every field's contents and every tensor's bytes, shape and type must equal gguf's own reader,
    and the tensors must stay read-only views of the file."""
    import gguf

    from engine.modelfile import default_model_path

    path = default_model_path()
    ours, theirs = gguf_reader(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        a, b = ours.fields[key].contents(), field.contents()
        assert a == b if not isinstance(b, np.ndarray) else np.array_equal(a, b), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.data_offset) == (b.tensor_type, list(b.shape), b.data_offset)
        assert not a.data.flags.writeable and np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda k: k.name)
def test_torch_decoding_of_stacked_experts_is_gguf_s_and_partial_blocks_are_refused(kind):
    """3-D ``[experts, rows, bytes]`` (MoE layers) decode as gguf does; a row that is not whole
    blocks is a typed error."""
    from engine.gguf_weights import dequantize
    from engine.quant import QuantFormatError

    blocks = _random_blocks(kind, 12, 256, seed=7).reshape(3, 4, -1)
    got, want = dequantize(blocks, kind.name), gguf.quants.dequantize(blocks, kind).astype(np.float32)
    assert got.shape == (3, 4, 256) and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(QuantFormatError, match=kind.name):
        dequantize(blocks[..., :-1], kind.name)


def test_every_smollm2_tensor_decodes_bit_for_bit_as_gguf_s():
    """SmolLM2's file (Q4_1 projections, a Q8_0 embedding, float32 norms)."""
    from engine.gguf_weights import dequantize
    from engine.modelfile import default_model_path

    kinds = set()
    for t in gguf_reader(default_model_path()).tensors:
        got = dequantize(t.data, t.tensor_type.name)
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        kinds.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0", "F32"} <= kinds
