"""No import circle among the project's modules.

Every .py file of the repository is a module (``pkg/sub/mod.py`` is ``pkg.sub.mod``, a package's
``__init__.py`` is the package). Each of its imports, at module level and inside functions alike,
relative ones resolved, is an arrow to the most specific project module it names: ``from a import
b`` points at ``a.b`` when that is a module, else at ``a``; imports of other distributions are
left out. The graph must have no cycle, whether or not Python happens to run the imports in an
order that works: two modules that import each other cannot be read, tested or moved apart. The
cure is to move the shared piece into a module both import, never to hide an import in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules"}


def project_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """module name -> (its file, whether it is a package's ``__init__``), for every .py file below
    ``root`` outside hidden folders (``.venv``, ``.git``) and build output."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(p.startswith(".") or p in SKIP_DIRS for p in parts[:-1]):
            continue
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = (path, package)
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of ``name`` that is a project module (None: not the project's)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def module_imports(name: str, path: Path, package: bool, modules: dict) -> set[str]:
    """The project modules that module ``name`` (file ``path``) imports anywhere in its body."""
    here = (name if package else name.rpartition(".")[0]).split(".")
    targets = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # from . import x (level 1: this package), from ..m import x (its parent)
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    resolved = {_resolve(t, modules) for t in targets}
    return {t for t in resolved if t and t != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports, for every module of `project_modules`."""
    modules = project_modules(root)
    return {name: module_imports(name, path, package, modules) for name, (path, package) in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]`` (each imports the next), or None if it has none.
    Depth first, in sorted order, so the same graph gives the same cycle."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, todo = [start], [iter(sorted(graph[start]))]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                done.add(path.pop())
                todo.pop()
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                todo.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_project_has_no_import_circle():
    graph = import_graph(ROOT)
    assert {"engine.generator", "bench.common", "loadtest.sample"} <= set(graph)   # the walk found the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_reports_a_circle_and_only_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"x"}}) == ["x", "y", "x"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None   # a diamond


def test_the_graph_resolves_relative_and_function_level_imports(tmp_path):
    files = {"pkg/__init__.py": "from .one import f\n",
             "pkg/one.py": "import json\n\n\ndef f():\n    from . import two\n    return two\n",
             "pkg/two.py": "from pkg.sub import deep\nimport pkg.sub\n",
             "pkg/sub/__init__.py": "",
             "pkg/sub/deep.py": "from ..one import f\nfrom pkg import two\n",
             ".venv/lib/pkg.py": "import pkg.one\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {"pkg": {"pkg.one"}, "pkg.one": {"pkg.two"}, "pkg.two": {"pkg.sub.deep", "pkg.sub"},
                     "pkg.sub": set(), "pkg.sub.deep": {"pkg.one", "pkg.two"}}
    assert find_cycle(graph) == ["pkg.one", "pkg.two", "pkg.sub.deep", "pkg.one"]
