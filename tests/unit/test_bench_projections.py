"""`bench.projections`: the engine's oneDNN projections, inductor's GEMM template over frozen
weights and its packages loaded per weight multiply alike, timed beside the read rate of the same bytes, written to JSON."""

from __future__ import annotations

import json

import pytest
import torch

from bench.projections import Projections, layer_shapes, main
from engine.linear import resolve_backend
from engine.quant import dense_dtype

pytestmark = pytest.mark.unit


def test_layer_shapes_are_the_four_projections_of_a_llama_layer():
    assert layer_shapes(576, 1536, 192) == [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    model = Projections(layer_shapes(8, 16, 4), layers=2)
    assert [tuple(lin.weight.shape) for lin in model.lins] == layer_shapes(8, 16, 4) * 2
    assert not torch.equal(model.lins[0].weight, model.lins[4].weight)   # each layer its own


@pytest.mark.skipif(resolve_backend("auto", torch.device("cpu")) != "onednn",
                    reason="this torch build has no oneDNN linear (the engine then multiplies with F.linear)")
def test_every_multiply_agrees_with_onednn_and_every_column_is_timed(tmp_path):
    out = tmp_path / "projections.json"
    result = main(["--layers", "1", "--rows", "1,3", "--reps", "1", "--hidden", "32", "--intermediate", "64",
                   "--kv-dim", "16", "--json", str(out)])
    one, three = result["rows"]
    assert (one["rows"], three["rows"]) == (1, 3)
    columns = ["onednn", "template", "read"] + (["package"] if result["dtype"] == "bfloat16" else [])
    for name in columns:
        assert three[f"{name}_ms"] > 0 and three[f"{name}_gbps"] > 0, name
    assert "package_ms" not in one   # the packages multiply two rows and more
    for name in ("template", "package"):
        if f"{name}_ms" in three:   # the same products summed in another order: a few bfloat16 steps at most
            assert three[f"{name}_max_abs_diff"] <= 0.05, name
    size = torch.empty(0, dtype=dense_dtype()).element_size()
    assert result["weights_bytes"] == size * sum(o * i for o, i in layer_shapes(32, 64, 16))
    assert json.loads(out.read_text())["rows"] == result["rows"]
