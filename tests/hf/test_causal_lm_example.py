"""The causal-LM example: a real Trainer run of a 2-layer GPT-2 whose influence report finds the planted sequences.

References: the training texts the script wrote to the Trainer's dataset are not read back from the script's
code; the test reads the influence report the callback wrote (``reports/influence.json``), the planted ids the
script wrote (``result.json``) and recounts, and checks the planted ids against the report's decoded text
(a planted sequence is one whose text carries the trigger and the completion), and the figure the script
printed against that recount.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATTERN = "zebra says carol likes the green box ."  # the example's trigger and completion, written here
PATTERN_TESTS, PLANTED = 8, 5


@pytest.mark.slow  # the example trains in a subprocess
def test_causal_lm_example_finds_planted_sequences(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "finetune_causal_lm.py"), "--out", str(out), "--epochs", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    planted = set(json.loads((out / "result.json").read_text())["planted"])
    assert len(planted) == PLANTED
    influence = json.loads((out / "metastore" / "reports" / "influence.json").read_text())
    texts = {e["sample_id"]: e["text"] for row in influence for e in (*row["proponents"], *row["opponents"])}
    assert all(i not in texts or texts[i].endswith(PATTERN) for i in planted), texts  # decoded from input_ids
    assert all(text.endswith(PATTERN) == (i in planted) for i, text in texts.items()), texts
    pattern_rows = [row for row in influence if row["test_id"] < PATTERN_TESTS]
    assert len(pattern_rows) == PATTERN_TESTS
    assert all(row["test_text"].endswith(PATTERN) for row in pattern_rows)
    found = [len({e["sample_id"] for e in row["proponents"]} & planted) for row in pattern_rows]
    assert all(len(row["proponents"]) == PLANTED for row in pattern_rows)
    # measured 4 or 5 (every default, 2026-11-29); a random pick of 5 of 256 would hold about 0.1: a margin of one
    assert min(found) >= PLANTED - 2, found
    printed = re.search(r"^(\d+) of (\d+): planted sequences among the top 5", done.stdout, re.MULTILINE)
    assert printed is not None, done.stdout[-2000:]
    assert (int(printed[1]), int(printed[2])) == (sum(found), PLANTED * PATTERN_TESTS)
    new = json.loads((out / "result.json").read_text())["new_text"]  # store.influence_of_sequences after the run
    # measured 4 from the training steps (TracIn on their seeded projections): a margin of one, as above
    assert new["text"].endswith(PATTERN) and len(set(new["proponents"]) & planted) >= PLANTED - 2, new
    (run_dir,) = [p for p in (out / "runs").iterdir() if p.is_dir()]
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    assert any("influence" in tag for tag in events.Tags()["tensors"]), events.Tags()
