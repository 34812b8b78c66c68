"""The README's main job, small: a ``Trainer`` run with the callback whose store and reports find flipped labels,
and whose influence table, in the files and in TensorBoard, shows the proponents' texts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from metastore_plugins import open_store

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_text_classifier.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_text_classifier", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensorboard_influence_table(run: Path) -> str:
    """The markdown of the influence table the callback wrote to TensorBoard, read back from the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = [p for p in (run / "runs").iterdir() if p.is_dir()]  # the Trainer's run directory
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    (tag,) = [tag for tag in events.Tags()["tensors"] if tag.startswith("metastore/influence")]
    return events.Tensors(tag)[-1].tensor_proto.string_val[0].decode()


@pytest.mark.slow  # the example trains in a subprocess
def test_example_run_produces_a_sound_store_and_reports_with_texts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--epochs", "2", "--train-size", "256"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    store = open_store(out)
    assert store.path == out / "metastore" and store.verify() == []
    assert store.capture_points() == ["epoch-0/train", "epoch-0/val", "epoch-1/train", "epoch-1/val", "train"]
    held = store.sample_ids("epoch-1/train").tolist()  # the attribution allowance's share of the 256
    assert len(set(held)) == len(held) >= 32 and set(held) <= set(range(256))
    reports = store.path / "reports"
    outliers = json.loads((reports / "outliers.json").read_text())
    flipped = set(json.loads((out / "flipped.json").read_text()))
    top = [row["sample_id"] for row in outliers[:10]]
    assert sum(sid in flipped for sid in top) >= 5, (top, sorted(flipped))  # 5% flipped overall
    assert (reports / "outliers.md").read_text().startswith("| rank | sample_id |")

    # the texts: each row's text is the composed review of that sample id (the data rebuilt apart, from the seeds)
    composed = example().reviews
    train_texts, val_texts = composed(256, seed=1, flip=0.05)[0]["text"], composed(64, seed=2, flip=0.0)[0]["text"]
    assert all(row["text"] == train_texts[row["sample_id"]] for row in outliers)
    influence = json.loads((reports / "influence.json").read_text())
    assert influence and all(len(row["proponents"]) == 5 for row in influence)
    assert {row["train_side"] for row in influence} == {"passes and steps"}  # every training sample ranked
    for row in influence:
        assert row["test_text"] == val_texts[row["test_id"]]
        assert all(p["text"] == train_texts[p["sample_id"]] for p in row["proponents"] + row["opponents"])
    board = tensorboard_influence_table(out)
    for row in influence:  # the table cuts long texts (with an ellipsis): their first 40 characters are always shown
        assert val_texts[row["test_id"]][:40] in board
        assert all(f"| + | {p['sample_id']} | {p['label']} |" in board for p in row["proponents"])
        assert all(train_texts[p["sample_id"]][:40] in board for p in row["proponents"])
    assert "id:label" not in board and str(outliers[0]["text"]) in done.stdout  # the summary shows the top texts
