"""The python examples of docs/store.md run as written, and print what their comments say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "store.md"


def test_store_doc_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 3
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "['final/test', 'final/train', 'train']"
    assert lines[1] == "[0, 1, 2, 3]"
    assert lines[2] == "32"
    np.testing.assert_array_equal(namespace["ids"], np.arange(8, 24))
    assert {k: tuple(v.shape) for k, v in namespace["grads"].items()}["0.weight"] == (16, 8)
    assert lines[3:5] == ["[(0, 8), (1, 8)]", "[(2, 8), (3, 8)]"]  # the chunks example
    assert lines[-2] == "(32, 2) [0 1 2] [32 33]"
    # the manifest shown in the doc has the keys a real one has
    manifest = json.loads((tmp_path / "runs/demo/store/manifest-rank0.json").read_text())
    text = DOC.read_text(encoding="utf-8")
    shown = json.loads(re.findall(r"```json\n(.*?)```", text, flags=re.S)[0])
    assert shown == manifest
