"""The package layering of docs/ARCHITECTURE.md, checked against the code's actual imports.

The table's last column names, in backticks, the project modules each package may import; an
import of any other project package (at module level or inside a function) fails the test. The
benchmarks (``bench/``) stay out of the serving path: a serving package importing ``bench`` fails
whatever its row says, ``deploy``'s "everything" included. The router must also run without
torch: importing its entry points must not load it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("engine", "kvtransfer", "rpc", "worker", "prefill", "decode", "router", "loadtest", "deploy")
PACKAGES = SERVING + ("bench",)


def _table() -> dict[str, tuple[str, ...] | None]:
    """package -> the project modules it may import (None: everything)."""
    allowed = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        m = re.match(r"\|\s*`(\w+)/`\s*\|[^|]*\|(?P<may>[^|]*)\|", line)
        if m and m.group(1) in PACKAGES:
            may = m.group("may")
            allowed[m.group(1)] = None if "everything" in may else tuple(re.findall(r"`([\w.]+)`", may))
    return allowed


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a project module in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, mod) for line, mod in out if mod.split(".")[0] in PACKAGES]


def _permitted(module: str, own: str, allowed: tuple[str, ...] | None) -> bool:
    if own in SERVING and module.split(".")[0] == "bench":
        return False
    return allowed is None or any(module == a or module.startswith(a + ".") for a in (own, *allowed))


def arrows_not_allowed(root: Path, package: str, allowed: tuple[str, ...] | None) -> list[str]:
    """``path:line imports module`` for each import in ``root/package`` that ``allowed`` (the
    package's table row, None: everything) does not permit, or that takes a serving package to
    ``bench``."""
    return [f"{path.relative_to(root)}:{line} imports {mod}"
            for path in sorted((root / package).rglob("*.py"))
            for line, mod in _imports(path) if not _permitted(mod, package, allowed)]


def test_the_table_covers_every_package():
    assert set(_table()) == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layering_table(package):
    allowed = _table()[package]
    bad = arrows_not_allowed(ROOT, package, allowed)
    assert not bad, f"arrows ARCHITECTURE.md does not allow for {package}/ (may import {allowed}):\n" + "\n".join(bad)


def test_the_router_process_imports_no_torch():
    code = ("import sys; import router.__main__, router.server, router.api, router.registry; "
            "from router.server import load_tokenizer; load_tokenizer(None); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the router loaded torch: {out.stdout[:300]}"


def test_the_table_keeps_bench_out_of_every_serving_package():
    table = _table()
    assert table["bench"] is None
    for package in SERVING:
        assert table[package] is None or "bench" not in table[package], package


@pytest.mark.parametrize("package", ["engine", "deploy"])   # a listed row, and an "everything" row
def test_a_serving_module_importing_bench_is_reported(tmp_path, package):
    (tmp_path / package).mkdir()
    (tmp_path / package / "fast.py").write_text(
        "import bench.engine\n\n\ndef timing():\n    from bench.common import timed\n    return timed\n")
    bad = arrows_not_allowed(tmp_path, package, _table()[package])
    assert bad == [f"{package}/fast.py:1 imports bench.engine", f"{package}/fast.py:5 imports bench.common.timed"]


def test_bench_may_import_any_package(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("import deploy.launcher\nfrom engine.loader import load_model\n")
    assert arrows_not_allowed(tmp_path, "bench", _table()["bench"]) == []


def test_tier_times_group_tests_by_their_folder():
    from tests.tier_times import summary, tier_of

    assert tier_of("tests/e2e/test_serving.py::test_x[1p1d]") == "e2e"
    assert tier_of("tests/unit/test_docs.py::test_y") == "unit"
    assert tier_of("test_top.py::z") == "other"
    line = summary({"unit": 60.0, "e2e": 600.0}, {"unit": {"a", "b"}, "e2e": {"c"}})
    assert line == "tier times: e2e 1 tests 10.0 min, unit 2 tests 1.0 min"
