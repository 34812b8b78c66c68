"""The package's layering, read from its source: no import cycle, and the storage engine imports nothing above it.

Every ``import`` statement counts, wherever it stands: at module level, inside a function,
or under ``if TYPE_CHECKING:``. ``from package import name`` is an edge to the submodule
``package.name`` when that is a module of the package, and to ``package`` otherwise.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import metastore_plugins
from metastore_plugins.core import ops

ROOT = Path(metastore_plugins.__file__).parent
PACKAGE = "metastore_plugins"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if child in known else source)
    return {target for target in found if target in known and target != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = graph()
    assert "metastore_plugins.core.analysis.gradient_store" in edges["metastore_plugins.core.analysis"]
    # a function-level import counts (the package's lazy callback import)
    assert "metastore_plugins.lightning_callback" in edges["metastore_plugins"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


#: The package's layers, bottom to top (docs/design.md draws them): a module imports only its own
#: package and packages of lower layers; two packages of one layer never import each other.
#: Old module paths kept for one release (core/_moved.py): they import nothing but that helper.
DEPRECATED_PATHS = ("core.passes", "core.rng", "core.options", "core.capture.records", "core.analysis.recompute")

LAYERS: list[tuple[str, ...]] = [
    ("core.errors", "core.process_group", "core.heap"),
    ("core.records", "core.progress", "core._moved"),  # _moved: its __getattr__ raises core.errors' UnknownNameError
    ("core.capture", "core.store"),
    ("core.ops",),
    ("core.policy", "core.model"),
    ("core.analysis",),
    ("core.distributed",),
    ("core.reports",),
    ("core.training",),
    # the adapters, the CLI, the package root, and the old paths kept for one release
    ("lightning_callback", "hf_callback", "loop", "cli", "testing", "", *DEPRECATED_PATHS),
]


def home_of(module: str) -> tuple[int, str]:
    """``(layer, package)`` of a module: the longest package of :data:`LAYERS` that holds it."""
    relative = module.removeprefix(PACKAGE).lstrip(".")
    homes = [
        (len(package), layer, package)
        for layer, packages in enumerate(LAYERS)
        for package in packages
        if package == "" or relative == package or relative.startswith(package + ".")
    ]
    _, layer, package = max(homes)
    return layer, package


def layering_breaches(edges: dict[str, set[str]]) -> list[str]:
    breaches = []
    for source, targets in sorted(edges.items()):
        layer, package = home_of(source)
        for target in sorted(targets):
            target_layer, target_package = home_of(target)
            upward = target_layer > layer
            sideways = target_layer == layer and target_package != package and package != ""
            if upward or sideways:
                breaches.append(f"{source} -> {target}")
    return breaches


def test_every_module_has_a_home_in_the_layers() -> None:
    assert home_of(f"{PACKAGE}.core.store.writing.writer") == (2, "core.store")
    assert home_of(f"{PACKAGE}.core.training.run") == (8, "core.training")
    assert home_of(f"{PACKAGE}.cli") == (9, "cli")
    unplaced = [name for name in graph() if name.startswith(f"{PACKAGE}.core.") and home_of(name)[1] == ""]
    assert unplaced == []


def test_the_breach_finder_finds_upward_and_sideways_imports() -> None:
    edges = {
        f"{PACKAGE}.core.store.writing.writer": {f"{PACKAGE}.core.capture.session", f"{PACKAGE}.core.errors"},
        f"{PACKAGE}.core.ops.norms": {f"{PACKAGE}.core.analysis.queries"},
        f"{PACKAGE}.core.training.run": {f"{PACKAGE}.core.analysis.refine"},
    }
    assert layering_breaches(edges) == [
        f"{PACKAGE}.core.ops.norms -> {PACKAGE}.core.analysis.queries",
        f"{PACKAGE}.core.store.writing.writer -> {PACKAGE}.core.capture.session",
    ]


def test_each_layer_imports_only_below_it() -> None:
    assert layering_breaches(graph()) == []


def test_core_imports_no_framework_adapter() -> None:
    adapters = (f"{PACKAGE}.lightning_callback", f"{PACKAGE}.hf_callback", f"{PACKAGE}.loop", f"{PACKAGE}.cli")

    def is_adapter(name: str) -> bool:  # a module of an adapter, the cli package's submodules included
        return any(name == adapter or name.startswith(adapter + ".") for adapter in adapters)

    edges = graph()
    assert is_adapter(f"{PACKAGE}.cli.output") and not is_adapter(f"{PACKAGE}.core.store")
    leaks = {name: sorted(filter(is_adapter, edges[name])) for name in edges if name.startswith(f"{PACKAGE}.core")}
    assert {name: targets for name, targets in leaks.items() if targets} == {}


def test_a_renamed_operator_result_keeps_its_old_name_for_one_release() -> None:
    with pytest.warns(DeprecationWarning, match="BatchContributors"):
        old = ops.Contributors
    assert old is ops.BatchContributors


def drawn_layers() -> dict[str, int]:
    """docs/design.md's picture of the layers: each package or module it names, with the layer it is drawn in."""
    picture = (ROOT.parent / "docs" / "design.md").read_text().split("```")[1]
    top_level = {"lightning_callback", "hf_callback", "loop", "cli", "testing"}
    drawn: dict[str, int] = {}
    layer = -1
    for line in picture.splitlines():
        fields = re.split(r"\s{2,}", line.strip())  # the picture's columns are two or more spaces apart
        if fields[0].isdigit():
            layer, fields = int(fields[0]), fields[1:]
        for field in fields:
            named = re.fullmatch(r"([a-z_]+)(?:/|\.py)", field)
            if named:
                name = named.group(1)
                drawn[name if name in top_level else f"core.{name}"] = layer
    return drawn


def test_the_design_page_draws_every_layer_where_the_code_has_it() -> None:
    drawn = drawn_layers()
    assert drawn["core.training"] == 8 and drawn["core.errors"] == 0 and drawn["cli"] == 9
    aliases = {
        "core._moved",
        "core.passes",
        "core.rng",
        "core.options",
        "core.capture.records",
        "core.analysis.recompute",
    }
    expected = {
        package: layer
        for layer, packages in enumerate(LAYERS)
        for package in packages
        if package and package not in aliases
    }
    assert {name: drawn.get(name) for name in expected} == expected


def test_the_training_adapters_reach_the_run_through_the_facade() -> None:
    """The Lightning, HF and plain-loop adapters drive a run through core/training/facade.py: none reaches into
    the reports, the store, or the pieces of a run the facade composes (issue 48)."""
    edges = graph()
    composed = ("run", "run_step", "run_start", "expectations", "lines", "passes")
    behind = [f"{PACKAGE}.core.reports", f"{PACKAGE}.core.store", f"{PACKAGE}.core.analysis", f"{PACKAGE}.core.policy"]
    behind += [f"{PACKAGE}.core.training.{name}" for name in composed]
    for adapter in ("lightning_callback", "hf_callback", "loop"):
        targets = edges[f"{PACKAGE}.{adapter}"]
        assert f"{PACKAGE}.core.training.facade" in targets
        reached = sorted(t for t in targets if any(t == b or t.startswith(b + ".") for b in behind))
        assert reached == [], adapter
