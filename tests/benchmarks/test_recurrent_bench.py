"""The recurrent benchmark runs at its tiny size and writes its JSON and doc section.

Not a timing test: it checks the table is there and that the captured run agrees with the fused one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the benchmark runs in a subprocess
def test_a_tiny_run_is_measured_and_the_doc_section_is_rewritten(tmp_path: Path) -> None:
    doc, out = tmp_path / "benchmarks.md", tmp_path / "recurrent.json"
    doc.write_text("# hand-written\n\n<!-- recurrent:start -->\nold\n<!-- recurrent:end -->\n\nkept\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "metastore_bench.recurrent_bench", "--size", "tiny", "--repeats", "1"]
    command += ["--warmup", "0", "--threads", "1", "--doc", str(doc), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {(entry["module"], entry["input"]) for entry in results.values()} == {
        (module, layout) for module in ("nn.LSTM", "nn.GRU") for layout in ("padded", "PackedSequence")
    }
    for entry in results.values():
        assert entry["grad_vs_fused"] <= 1e-5 and entry["per_sample_sum_vs_fused"] <= 1e-5
        assert entry["record_bytes"] > 0 and entry["saved_bytes"]["captured"] > 0
    text = doc.read_text()
    assert "old" not in text and text.rstrip().endswith("kept") and "| `nn.LSTM` | padded |" in text
