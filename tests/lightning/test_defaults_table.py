"""The defaults tables of docs/lightning.md and docs/hf.md list every argument of ``MetaStoreCallback`` and
``MetaStoreTrainerCallback`` (their signatures and the shared settings) and ``tag()``, each with the default
the code has (both pages here: one parser)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

from metastore_plugins.core.training.settings import SETTINGS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def defaults_table(page: Path) -> dict[str, str]:
    """Setting name -> its cell in the Default column, from the page's ``## Defaults`` table."""
    section = page.read_text().split("## Defaults", 1)[1].split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([^`(]+)(?:\([^`]*\))?`", cells[0])
        values = cells[1].split(", ") if len(names) > 1 else [cells[1]]
        assert len(values) == len(names), f"{page.name}: row {cells[0]} has {len(values)} defaults"
        for name, value in zip(names, values, strict=True):
            assert name not in table, f"{page.name} lists {name} twice"
            table[name] = value
    return table


def expected_defaults(callback: type) -> dict[str, Any]:
    """Every constructor argument of ``callback`` with its default, from the signature and the settings table."""
    found: dict[str, Any] = {}
    for name, parameter in inspect.signature(callback.__init__).parameters.items():
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and name != "self":
            found[name] = parameter.default
    return found | {row.name: row.default for row in SETTINGS}


def literal(value: Any) -> str | None:
    """How the table writes a plain default (None: a default the table describes in words)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (bool, int, float)):
        return repr(value)
    return None


def check_page(page: Path, callback: type) -> None:
    table = defaults_table(page)
    expected = expected_defaults(callback)
    assert sorted(set(expected) - set(table)) == [], f"{page.name} leaves out these arguments"
    assert sorted(set(table) - set(expected) - {"callback.tag"}) == [], f"{page.name} lists unknown arguments"
    assert "callback.tag" in table  # the method users call, with its own defaults
    for name, value in expected.items():
        written = literal(value)
        if written is not None:
            assert f"`{written}`" in table[name], f"{page.name}: {name} defaults to {written}, not {table[name]}"


def test_the_lightning_defaults_table_lists_every_argument_with_its_default() -> None:
    pytest.importorskip("lightning")
    from metastore_plugins import MetaStoreCallback

    check_page(DOCS / "lightning.md", MetaStoreCallback)


def test_the_hf_defaults_table_lists_every_argument_with_its_default() -> None:
    pytest.importorskip("transformers")
    from metastore_plugins import MetaStoreTrainerCallback

    check_page(DOCS / "hf.md", MetaStoreTrainerCallback)
