"""The HF example, small: a real Trainer run whose outlier report finds the flipped labels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the example trains in a subprocess
def test_hf_example_finds_flipped_labels(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_text_classifier.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["top"] == 60 and result["flipped"] > 0
    assert result["recall"] >= 0.6, result  # a random 10% would hold about 10%
    store_files = {p.name for p in (out / "metastore").iterdir()}
    assert "manifest-rank0.json" in store_files
    (run_dir,) = [p for p in (out / "runs").iterdir() if p.is_dir()]
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    assert any("outlier" in tag for tag in events.Tags()["tensors"]), events.Tags()
