"""The generic-against-specific capture benchmark runs at its tiny size and writes its JSON and doc section.

Not a timing test: it checks the table is there and that both rules gave the same gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


@pytest.mark.slow  # the benchmark runs in a subprocess
def test_a_tiny_run_is_measured_and_the_doc_section_is_rewritten(tmp_path: Path) -> None:
    doc, out = tmp_path / "benchmarks.md", tmp_path / "capture_families.json"
    doc.write_text("# hand-written\n\n<!-- capture-families:start -->\nold\n<!-- capture-families:end -->\n\nkept\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "metastore_bench.capture_families", "--size", "tiny", "--repeats", "1"]
    command += ["--warmup", "0", "--threads", "1", "--doc", str(doc), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert len(results["layers"]) == 4 and len(results["models"]) == 2
    for entry in results["layers"].values():
        assert list(entry["variants"]) == ["no capture", "specific rule", "generic rule"]
        assert entry["max_relative_difference"] <= 1e-5  # the two rules agree
        assert entry["generic_parameters"]["specific rule"] == []
        assert entry["generic_parameters"]["generic rule"]  # forced through the generic rule
    for entry in results["models"].values():
        generic = entry["generic_parameters"]
        assert generic["generic=False (those parameters not captured)"] == [] and generic["generic rule (the default)"]
    text = doc.read_text()
    assert "old" not in text and text.rstrip().endswith("kept") and "| `nn.Linear(8, 8)` |" in text
