"""tests/README.md names every test folder and every shared cases module there is (issue 48)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_the_tests_readme_names_every_folder_and_cases_module() -> None:
    page = (TESTS / "README.md").read_text()
    folders = {path.parent.name for path in TESTS.glob("*/test_*.py")}
    cases = {path.stem for path in TESTS.rglob("*cases.py")}
    assert len(folders) >= 13 and "capturecases" in cases
    named = set(re.findall(r"`([a-z_]+)/`", page))
    assert sorted(folders - named) == []
    assert sorted(name for name in cases if not re.search(rf"`(?:[a-z_]+/)?{name}(?:\.py)?`", page)) == []
