"""The callback-overhead benchmark runs the Lightning example in each variant and writes its table.

Not a timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("lightning")
pytest.importorskip("sklearn")


@pytest.mark.slow  # the benchmark runs in a subprocess
def test_lightning_variants_run_and_the_doc_section_is_rewritten(tmp_path: Path) -> None:
    doc, out = tmp_path / "benchmarks.md", tmp_path / "callbacks.json"
    earlier = {
        "script": "examples/finetune_bert.py",
        "measured": "2026-01-01 00:00 UTC, 2 round(s)",
        "variants": {"no callback": {"median_s": 20.0, "times_s": [20.0], "ratio": 1.0}},
    }
    out.write_text(json.dumps({"results": {"hf": earlier}}))  # an earlier run of the other example
    doc.write_text("# hand-written\n\n<!-- callbacks:start -->\nold table\n<!-- callbacks:end -->\n\nkept below\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "metastore_bench.callback_bench",
            "--only",
            "lightning",
            "--rounds",
            "1",
            "--doc",
            str(doc),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    variants = json.loads(out.read_text())["results"]["lightning"]["variants"]
    assert list(variants) == [
        "no callback",
        "training steps captured",
        "+ checkpoint passes",
        "+ reports (the example)",
        "outliers from the training steps, 256-sample passes, reports",
        "policy='exact': training steps captured",
    ]
    assert all(len(v["times_s"]) == 1 and v["median_s"] > 0 for v in variants.values())
    assert variants["no callback"]["ratio"] == 1.0
    text = doc.read_text()
    assert text.startswith("# hand-written") and text.rstrip().endswith("kept below") and "old table" not in text
    assert "| `examples/lightning_digits.py` | + reports (the example) |" in text
    assert json.loads(out.read_text())["results"]["hf"] == earlier  # kept, with when it was measured
    # an earlier run's row: no pass/report/refinement seconds or peak memory were measured then (blank cells)
    assert "| `examples/finetune_bert.py` | no callback | 20.00 s | 1.00x |  |  |  |  |  | 20.00 |" in text
    assert "- `examples/finetune_bert.py`: 2026-01-01 00:00 UTC, 2 round(s)" in text
