"""The README's main job, small: a real training run that produces a store and reports that find flipped labels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from metastore_plugins import open_store
from metastore_plugins.core.reports import INFLUENCE_SAMPLES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the example trains in a subprocess
def test_example_run_produces_a_sound_store_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_text_classifier.py"),
            "--out",
            str(out),
            "--epochs",
            "2",
            "--train-size",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    store = open_store(out / "store")
    assert store.verify() == []
    assert store.capture_points() == ["epoch-0/train", "epoch-0/val", "epoch-1/train", "epoch-1/val", "train"]
    assert sorted(store.sample_ids("epoch-1/train").tolist()) == list(range(256))
    reports = out / "store" / "reports"
    outliers = json.loads((reports / "outliers.json").read_text())
    flipped = set(json.loads((reports / "flipped.json").read_text()))
    top = [row["sample_id"] for row in outliers[:10]]
    assert sum(sid in flipped for sid in top) >= 5, (top, sorted(flipped))  # ~5% flipped overall
    influence = json.loads((reports / "influence.json").read_text())
    assert len(influence) == INFLUENCE_SAMPLES and all(len(row["proponents"]) == 5 for row in influence)  # of 64
    assert (reports / "outliers.md").read_text().startswith("| rank | sample_id |")
