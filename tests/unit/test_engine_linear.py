"""engine/linear.py: the one-row gemv copies are kept only where timing at load finds them
faster, and then consistently for every projection; many-row inputs padded to a few row buckets
(and those warmed) so that oneDNN builds few primitives."""

from __future__ import annotations

import time

import torch

from engine.linear import (BUCKET_FROM_ROWS, Linear, bf16_matmul_fast, bucket_rows, gemv_copy_pays, onednn_available,
                           warm_row_buckets)


class _TimedPaths:
    """A stand-in `Linear` whose two one-row paths cost a known time (a fake: the real kernels'
    speeds cannot be set; only the decision is under test)."""

    in_features = 4

    def __init__(self, gemv_s: float, packed_s: float):
        self.gemv_s, self.packed_s = gemv_s, packed_s

    def gemv(self, x):
        time.sleep(self.gemv_s)

    def packed(self, x):
        time.sleep(self.packed_s)


def test_gemv_copies_pay_only_when_faster():
    assert gemv_copy_pays([_TimedPaths(1e-3, 3e-3)], reps=3)
    assert not gemv_copy_pays([_TimedPaths(3e-3, 1e-3)], reps=3)


def test_both_one_row_paths_compute_the_same_product():
    if not onednn_available():
        import pytest

        pytest.skip("this torch build has no oneDNN packed linear")
    w, x = torch.randn(64, 32), torch.randn(1, 32)
    lin = Linear(w, "onednn", gemv_copy=True)
    assert lin.has_gemv_copy
    torch.testing.assert_close(lin.gemv(x), lin.packed(x), rtol=1e-4, atol=1e-4)
    lin.drop_gemv_copy()
    assert not lin.has_gemv_copy
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-4, atol=1e-4)


def test_the_models_choice_holds_for_every_projection():
    from engine.loader import load_model

    m = load_model(weights="fp32")
    linears = [p for lin in m.model._layers for p in vars(lin).values()] + [m.model._lm_head]
    assert {p.has_gemv_copy for p in linears} == {m.model.gemv_copies}
    m = load_model(weights="fp32", gemv_copies=False)   # a prefill worker: never a copy
    assert not m.model.gemv_copies


def test_row_buckets_bound_the_padding_and_the_shapes():
    """`bucket_rows`: decode-sized inputs keep their rows; above `BUCKET_FROM_ROWS`, at least the
    rows, at most an eighth more, from a small set (52 row counts for any prompt up to 8192)."""
    assert [bucket_rows(r) for r in (1, 7, 32, BUCKET_FROM_ROWS)] == [1, 7, 32, BUCKET_FROM_ROWS]
    assert [bucket_rows(r) for r in (65, 300, 320, 321, 1100, 8192)] == [80, 320, 320, 352, 1152, 8192]
    for rows in range(BUCKET_FROM_ROWS + 1, 8193):
        b = bucket_rows(rows)
        assert rows <= b <= rows + max(16, rows // 8) and b == bucket_rows(b)
    assert len({bucket_rows(r) for r in range(BUCKET_FROM_ROWS + 1, 8193)}) == 52


def test_a_padded_multiply_returns_exactly_the_rows_asked():
    """Above `BUCKET_FROM_ROWS` rows the oneDNN path multiplies zero-padded inputs: the result
    has the input's rows, contiguous, each the row's own product (a wrong slice or padding
    offset fails), in float32 and, where oneDNN multiplies it natively, bfloat16."""
    if not onednn_available():
        import pytest

        pytest.skip("this torch build has no oneDNN packed linear")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_matmul_fast() else [])
    for dtype in dtypes:
        lin = Linear(w.to(dtype), "onednn")
        for rows in (BUCKET_FROM_ROWS, BUCKET_FROM_ROWS + 1, 300, 321):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            y = lin(x)
            assert y.shape == (rows, 96) and y.is_contiguous() and y.dtype == dtype
            ref = torch.nn.functional.linear(x.float(), w.to(dtype).float())
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * 8)


def test_warming_the_buckets_runs_each_kernel_at_each_bucket_and_thread_count():
    if not onednn_available():
        import pytest

        pytest.skip("this torch build has no oneDNN packed linear")
    seen = []

    class Recording(Linear):   # the real kernel, its calls recorded
        def __call__(self, x):
            seen.append((x.shape[0], torch.get_num_threads()))
            return super().__call__(x)

    kernels = [Recording(torch.randn(32, 16), "onednn"), Recording(torch.randn(8, 16), "onednn"),
               Recording(torch.randn(8, 16), "torch")]   # F.linear builds no primitive: skipped
    threads = torch.get_num_threads()
    calls = warm_row_buckets(kernels, 300, (1, 2))
    buckets = [80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 288, 320]
    assert calls == len(seen) == len(buckets) * 2 * 2
    assert sorted(set(seen)) == sorted((b, n) for b in buckets for n in (1, 2))
    assert torch.get_num_threads() == threads


def test_the_template_backend_multiplies_decode_rows_through_its_copy_and_the_rest_through_onednn(monkeypatch):
    import pytest

    from engine.gemm_template import TemplateLinear

    from engine.linear import TEMPLATE_MAX_ROWS, resolve_backend, warm_templates

    if not bf16_matmul_fast():
        with pytest.raises(ValueError, match="native bfloat16"):
            resolve_backend("template", torch.device("cpu"))
        pytest.skip("no native bfloat16 matmuls on this CPU: the template backend is refused (checked above)")
    assert resolve_backend("template", torch.device("cpu")) == "template"
    with pytest.raises(ValueError, match="CPU weights"):
        resolve_backend("template", torch.device("cuda"))
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(80, 64, generator=gen) * 0.125).to(torch.bfloat16)   # the shape of tests/unit/test_gemm_template.py
    lin = Linear(w, "template")
    assert lin.template is not None and lin.backend == "onednn" and lin.bucketed
    assert Linear(w.float(), "template").template is None   # float32 weights: oneDNN only
    assert warm_templates([lin, Linear(w.float(), "template")], (1,)) == 1
    calls, run = [], TemplateLinear.__call__
    monkeypatch.setattr(TemplateLinear, "__call__", lambda self, x: calls.append(x.shape[0]) or run(self, x))
    for rows in (1, 2, 17, TEMPLATE_MAX_ROWS, TEMPLATE_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(lin(x).float(), (x @ w.T).float(), rtol=1e-2, atol=2e-2)
    assert calls == [2, 17, TEMPLATE_MAX_ROWS]   # one row and prompt-sized passes stay on oneDNN


def test_a_worker_warms_the_buckets_up_to_the_warm_bound_or_its_pass_budget_the_fewer(caplog):
    """`worker.kernels.warm_pass_primitives` on a model's real `Linear` kernels: buckets up to
    `WARM_BUCKET_ROWS` with the default 2048-token budget, up to the budget where it is lower;
    the log line names the bound."""
    import logging

    from engine.linear import WARM_BUCKET_ROWS
    from worker.config import WorkerConfig
    from worker.kernels import pass_thread_counts, warm_pass_primitives

    if not onednn_available():
        import pytest

        pytest.skip("this torch build has no oneDNN packed linear")
    seen = []

    class Recording(Linear):   # the real kernel, its calls recorded
        def __call__(self, x):
            seen.append(x.shape[0])
            return super().__call__(x)

    class Model:
        def projection_kernels(self):
            return [Recording(torch.randn(8, 16), "onednn")]

    for budget, top in ((2048, WARM_BUCKET_ROWS), (300, 320)):
        config = WorkerConfig(role="prefill", max_num_batched_tokens=budget)
        seen.clear()
        with caplog.at_level(logging.INFO, logger="worker.kernels"):
            warm_pass_primitives(config, Model())
        buckets = sorted({bucket_rows(r) for r in range(BUCKET_FROM_ROWS + 1, min(budget, WARM_BUCKET_ROWS) + 1)})
        assert max(seen) == top and sorted(set(seen)) == buckets
        assert len(seen) == len(buckets) * len(pass_thread_counts(config, BUCKET_FROM_ROWS + 1))
        assert f"up to {min(budget, WARM_BUCKET_ROWS)} rows" in caplog.text
