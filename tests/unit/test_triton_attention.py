"""`engine.triton_attention.paged_decode` against a reference, on the CPU under Triton's
interpreter: grouped-query heads, ragged lengths, block tables scattered over the pool, block
sizes, sliding windows, soft-capping, a bfloat16 pool, and a tiny model's decode step through the
engine's dispatch. The kernel runs in a process of its own (`tests/unit/triton_cases.py`, with
``TRITON_INTERPRET=1``: Triton fixes interpretation when it is imported); the checks run here.
The same kernel is what CUDA pools run (`engine.attention`)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import run_interpreted

pytest.importorskip("triton", reason="triton is in the dev extra")
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "cases.pt"
    run_interpreted("tests.unit.triton_cases", str(out))
    return torch.load(out, weights_only=False)


def reference(q, k_pool, v_pool, tables, lens, block, window, scale, softcap):
    """Each sequence's K/V gathered by its table, attended in float64."""
    out = []
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    for i, n in enumerate(lens.tolist()):
        slots = (tables[i, :, None] * block + torch.arange(block)).flatten()[:n]
        flat_k, flat_v = (p.transpose(1, 2).reshape(-1, kv_heads, p.shape[3]) for p in (k_pool, v_pool))
        k = flat_k[slots].double().repeat_interleave(heads // kv_heads, dim=1)   # [n, heads, dim]
        v = flat_v[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s[:, : max(0, n - window)] = float("-inf")
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("name", ["mha", "gqa", "gqa3-dim24-block32", "window", "softcap", "all-one-kv-head",
                                  "bf16-pool"])
def test_paged_decode_equals_the_reference(results, name):
    c = results["cases"][name]
    want = reference(c["q"], c["k_pool"], c["v_pool"], c["tables"], c["lens"], c["block"], c["window"],
                     c["scale"], c["softcap"])
    assert c["out"].shape == c["q"].shape and c["out"].dtype == c["q"].dtype
    assert (c["out"].double() - want).abs().max().item() < 2e-5
    # the check can fail: the last sequence's last block taken from another sequence's K/V
    assert (c["wrong"][-1].double() - want[-1]).abs().max().item() > 1e-3


def test_shapes_that_do_not_fit_are_refused(results):
    errors = results["errors"]
    assert "does not fit" in errors["heads"]
    assert "power of two" in errors["block"]
    assert "positive" in errors["window"]


def test_a_model_decodes_through_the_kernel_as_through_sdpa(results):
    model = results["model"]
    assert (model["kernel"] - model["sdpa"]).abs().max().item() < 1e-4
