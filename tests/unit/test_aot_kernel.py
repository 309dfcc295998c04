"""`engine.aot_kernel`: the CPU attention kernels compiled ahead of time and kept on disk. A
fresh process (a restarted worker) loads the package another built, without importing dynamo or
inductor, and computes what the eager kernel computes; a package the runtime refuses is built
again; the cache key follows the thread count, the kernel's parameters and its source."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.aot_kernel import cache_dir, package_key
from engine.glue import CompiledGlue
from engine.paged_decode import CompiledDecode, head_major, paged_decode_indexed

pytestmark = pytest.mark.unit

SCALE = 0.123   # a scale no other test uses: this file's package has a key of its own
CASE = textwrap.dedent("""
    import torch
    from engine.attention import ForwardBatch, SeqChunk
    g = torch.Generator().manual_seed(3)
    k_pool, v_pool = (torch.randn(2, 16, 4, 16, generator=g).bfloat16().transpose(0, 1) for _ in range(2))
    q = torch.randn(5, 4, 16, generator=g) * 3
    lens = [9, 3, 16, 12, 7]
    batch = ForwardBatch.build([SeqChunk([1], n - 1, list(range(3 * i, 3 * i + -(-n // 4))))
                                for i, n in enumerate(lens)], 4)
    tables, lens_t = batch.indexed_decode_inputs()
""")


def _case():
    scope: dict = {}
    exec(CASE, scope)
    return scope


def _eager(c):
    return paged_decode_indexed(c["q"], c["k_pool"], c["v_pool"], c["tables"], c["lens_t"], None, SCALE, None)


def test_a_restarted_process_loads_the_package_without_dynamo_and_gets_the_eager_result():
    c = _case()
    kernel = CompiledDecode()
    torch.testing.assert_close(kernel(c["q"], c["k_pool"], c["v_pool"], c["batch"], None, SCALE, None), _eager(c),
                               rtol=1e-5, atol=1e-5)
    (package,) = kernel.packages.values()
    assert package.path.parent == cache_dir() and package.path.exists()
    script = CASE + textwrap.dedent(f"""
        import json, sys
        torch.set_num_threads({torch.get_num_threads()})
        from engine.paged_decode import CompiledDecode, paged_decode_indexed
        kernel = CompiledDecode()
        out = kernel(q, k_pool, v_pool, batch, None, {SCALE}, None)
        want = paged_decode_indexed(q, k_pool, v_pool, tables, lens_t, None, {SCALE}, None)
        (package,) = kernel.packages.values()
        print(json.dumps({{"built": package.built, "path": str(package.path),
                          "diff": float((out - want).abs().max()),
                          "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    restarted = json.loads(done.stdout.strip().splitlines()[-1])
    assert restarted == {"built": False, "path": str(package.path), "diff": restarted["diff"],
                         "dynamo": False, "inductor": False}
    assert restarted["diff"] < 1e-5


def test_a_package_the_runtime_refuses_is_built_again(caplog):
    """With the smallest package a worker builds (the fused SiLU x up of one row on SmolLM2's
    widths, `engine.glue`; loaded when an earlier test left it), truncated as a crash while
    copying would leave it: the next load warns, builds it again in the same place, and the
    rebuilt package computes the operator."""
    gate_up = torch.randn(1, 2 * 1536, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        glue = CompiledGlue()
        glue.silu_mul(gate_up)   # built or loaded
        (package,) = glue.packages.values()
        package.path.write_bytes(package.path.read_bytes()[:100])
        glue = CompiledGlue()
        with caplog.at_level(logging.WARNING, logger="engine.aot_kernel"):
            out = glue.silu_mul(gate_up)
    assert "building it again" in caplog.text
    (rebuilt,) = glue.packages.values()
    assert rebuilt.built and rebuilt.path == package.path
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_the_cache_key_follows_threads_parameters_and_source(tmp_path):
    src = tmp_path / "kernel.py"
    src.write_text("x = 1\n")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = package_key("k", {"scale": 0.5}, [src])
        assert package_key("k", {"scale": 0.5}, [src]) == one
        assert package_key("k", {"scale": 0.25}, [src]) != one
        assert package_key("other", {"scale": 0.5}, [src]) != one
        torch.set_num_threads(2)
        assert package_key("k", {"scale": 0.5}, [src]) != one
        torch.set_num_threads(1)
        src.write_text("x = 2\n")
        assert package_key("k", {"scale": 0.5}, [src]) != one
    finally:
        torch.set_num_threads(threads)


def test_one_package_serves_head_major_pools_of_every_size_and_other_layouts_get_their_own():
    """The pool a worker allocates is a view of head-major storage (`engine.kv_cache.KVPool`), its
    block count set by ``--num-blocks``: one package (built for the first size) computes the eager
    result over pools of 16 and 40 blocks; a block-major pool of the same shape, whose strides the
    package was not built for, gets a package of its own, and so would a pool of one block."""
    c = _case()
    kernel = CompiledDecode()
    g = torch.Generator().manual_seed(11)
    larger = tuple(torch.randn(2, 40, 4, 16, generator=g).bfloat16().transpose(0, 1) for _ in range(2))
    block_major = (c["k_pool"].contiguous(), c["v_pool"].contiguous())
    assert head_major(c["k_pool"], c["v_pool"]) and head_major(*larger) and not head_major(*block_major)
    assert not head_major(c["k_pool"][:1], c["v_pool"][:1])
    for k_pool, v_pool in ((c["k_pool"], c["v_pool"]), larger, block_major):
        want = paged_decode_indexed(c["q"], k_pool, v_pool, c["tables"], c["lens_t"], None, SCALE, None)
        torch.testing.assert_close(kernel(c["q"], k_pool, v_pool, c["batch"], None, SCALE, None), want,
                                   rtol=1e-5, atol=1e-5)
        if k_pool is larger[0]:
            assert len(kernel.packages) == 1
    assert len(kernel.packages) == 2
