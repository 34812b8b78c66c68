"""The examples use the public API only: every ``import`` of this package in ``examples/*.py`` names a public module,
and from the package root only names of its ``__all__``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import metastore_plugins

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PACKAGE = "metastore_plugins"

#: The public API, defined here once: module -> the names it offers (``None``: every name). The package root offers
#: its ``__all__`` (the callbacks, the store, capture, ``phase_seconds``); ``testing`` is the documented reference
#: for capture rules (docs/capture.md). Everything under ``metastore_plugins.core`` is internal.
PUBLIC: dict[str, frozenset[str] | None] = {
    PACKAGE: frozenset(metastore_plugins.__all__),
    f"{PACKAGE}.testing": None,
}


def private_imports(source: str) -> list[str]:
    """Each import of ``source`` that reaches below the public API, as ``module`` or ``module.name``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            found += [m for m in modules if (m == PACKAGE or m.startswith(PACKAGE + ".")) and m not in PUBLIC]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE and not node.level:
            module = node.module or ""
            if module not in PUBLIC:
                found.append(module)
                continue
            offered = PUBLIC[module]
            found += [f"{module}.{a.name}" for a in node.names if offered is not None and a.name not in offered]
    return found


def test_the_checker_refuses_internal_modules_and_names() -> None:
    source = "\n".join(
        [
            "import metastore_plugins",
            "from metastore_plugins import MetaStoreCallback, open_store",
            "from metastore_plugins.testing import reference_per_sample_gradients",
            "from metastore_plugins.core.training.lines import phase_seconds",
            "import metastore_plugins.core.reports.tables as tables",
            "from metastore_plugins import core",
            "def late():\n    from metastore_plugins.hf_callback import MetaStoreTrainerCallback",
            "from numpy import core as numpy_core",
        ]
    )
    assert private_imports(source) == [
        "metastore_plugins.core.training.lines",
        "metastore_plugins.core.reports.tables",
        "metastore_plugins.core",
        "metastore_plugins.hf_callback",
    ]


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.py")), ids=lambda path: path.name)
def test_an_example_imports_only_the_public_api(example: Path) -> None:
    assert private_imports(example.read_text()) == []


def test_every_public_name_is_there() -> None:
    missing = [name for name in metastore_plugins.__all__ if not hasattr(metastore_plugins, name)]
    assert missing == [] and len(list(EXAMPLES.glob("*.py"))) >= 5
