"""The examples of the "Training-dynamics queries" section of docs/queries.md run as written."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "queries.md"


def section_code(title: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else len(text)], flags=re.S)


def test_training_dynamics_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths of the examples land in this test's directory
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and their tempfile.mkdtemp() stores too
    blocks = section_code("Training-dynamics queries")
    assert len(blocks) == 8  # set-up, then one per method group
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    printed = capsys.readouterr().out
    assert "0.weight" in printed and "(64, 64) (64,)" in printed
    assert "sketches True" in printed and "(32, 32)" in printed
