"""The store-at-scale benchmark runs end to end on a small run and writes its JSON and its doc table.

Not a timing test: it checks the figures are there and say what the store holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the benchmark runs in a subprocess
def test_a_small_run_is_measured_and_the_doc_section_is_rewritten(tmp_path: Path) -> None:
    doc, out = tmp_path / "benchmarks.md", tmp_path / "store_scale.json"
    doc.write_text("# hand-written\n\n<!-- store_scale:start -->\nold\n<!-- store_scale:end -->\n\nkept below\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "metastore_bench.store_scale", "--steps", "400", "--batch", "4"]
    command += ["--shard-bytes", "4096", "--repeats", "1", "--name", "small", "--out", str(out), "--doc", str(doc)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    run = json.loads(out.read_text())["runs"]["small"]
    assert run["rows"] == 1600 and run["read"]["sample_ids_rows"] == 1600
    assert run["disk"]["shards"] > 1  # 4 KiB shards: many of them
    assert run["compact"]["shards_after"] < run["disk"]["shards"]
    text = doc.read_text()
    assert "old" not in text and "kept below" in text and "| small |" in text
