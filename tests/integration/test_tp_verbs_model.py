"""KV between TP groups over verbs with the model, in the RDMA lab: a prefill worker at TP 2 into a
decode worker at TP 1, and TP 1 into TP 2, every rank opening the device with its own MR and QPs,
greedy tokens equal to the TP-1 engine's (the tiny Qwen2 of test_tp_disaggregated.py).

Four minutes under the lab's emulated CPU, past CI's budget for TP tests: run on request
(``PDSERVE_LAB_TP_MODEL=1 pytest -m rdma tests/integration/test_tp_verbs_model.py``); CI runs the
same rank-to-rank verbs writes without a model (test_kvtransfer_tp_routes.py). Everything heavy is
imported inside the test, so the lab's session collects this module in no time.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.rdma, pytest.mark.timeout(900)]


@pytest.mark.parametrize("a,b", [(2, 1), (1, 2)])
def test_kv_between_tp_sizes_over_verbs(tmp_path_factory, a, b):
    if not os.environ.get("PDSERVE_LAB_TP_MODEL"):   # evaluated in the lab; the proxy reports the skip
        pytest.skip("4 minutes under the lab's emulated CPU, past CI's budget for TP tests: set "
                    "PDSERVE_LAB_TP_MODEL=1 to run it; CI runs the same rank-to-rank verbs writes without a "
                    "model (test_kvtransfer_tp_routes.py)")
    from engine.loader import load_model
    from tests.integration.test_model_families import build_checkpoint, save_tokenizer
    from tests.integration.test_tensor_parallel import CHECKPOINTS
    from tests.integration.test_tp_disaggregated import PROMPTS, check_pair, greedy, pair

    tok = save_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    qwen2 = build_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), tok, CHECKPOINTS["qwen2"])
    reference = greedy(load_model(qwen2, weights="fp32"), PROMPTS)
    with pair(qwen2, a, b, "verbs") as (prefill, decode):
        check_pair(prefill, decode, "d", reference, 4)
