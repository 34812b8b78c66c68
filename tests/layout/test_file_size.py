"""Every module of the package is under 400 lines (issue 48): a module that grows past it is split by role."""

from __future__ import annotations

from pathlib import Path

import metastore_plugins

ROOT = Path(metastore_plugins.__file__).parent
#: The most lines a module of the package may have (tests and examples are not counted).
MAX_LINES = 399


def line_counts(root: Path) -> dict[str, int]:
    """The lines of every ``.py`` file below ``root``, by path relative to it."""
    return {str(path.relative_to(root)): len(path.read_bytes().splitlines()) for path in sorted(root.rglob("*.py"))}


def test_the_count_reads_every_module_and_its_lines(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n" * 3)
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "b.py").write_text("\n\ny = 2")  # no newline at the end: still its line
    assert line_counts(tmp_path) == {"a.py": 3, "room/b.py": 3}
    assert len(line_counts(ROOT)) > 200


def test_every_module_is_under_400_lines() -> None:
    assert {name: lines for name, lines in line_counts(ROOT).items() if lines > MAX_LINES} == {}
