"""The benchmark harness has no import cycle, read from its source as tests/layout does for the package.

Every ``import`` counts, wherever it stands (module level, inside a function, under ``if TYPE_CHECKING:``);
``from package import name`` is an edge to the module ``package.name`` when there is one, else to ``package``.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "metastore_bench"


def modules(root: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``root`` (a package ``__init__`` named as its package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (source ``path``) imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names)
    return {target for target in found if target in known and target != name}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``edges`` (its modules in order, the first repeated last), or ``[]``."""
    try:
        TopologicalSorter(edges).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return []


def test_the_graph_sees_relative_function_level_and_package_imports() -> None:
    edges = graph()
    assert "metastore_bench.stores" in edges["metastore_bench.analytics_bench"]
    assert "metastore_bench.stores" in edges["metastore_bench.scaling_bench"]  # inside a function
    assert "metastore_bench.publish" in edges["metastore_bench.quality.__main__"]  # from ..publish import
    assert "metastore_bench.quality.lds" in edges["metastore_bench.quality.__main__"]  # from . import lds


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert sorted(cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})[:3]) == ["a", "b", "c"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_benchmark_modules() -> None:
    assert cycle(graph()) == []
