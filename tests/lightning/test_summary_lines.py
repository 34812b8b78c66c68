"""The callback says, in one line at the start and one at the end, where the store and reports went and how
to open them (Lightning's rank-zero logging)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from lightning_cases import Classifier, fit, loaders

from metastore_plugins import MetaStoreCallback, open_store


def test_start_and_end_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train, val = loaders()
    callback = MetaStoreCallback(tmp_path / "store")
    with caplog.at_level(logging.INFO):
        trainer = fit(tmp_path, Classifier(), train, val, [callback], max_epochs=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MetaStoreCallback:")]
    assert len(lines) == 3  # start, the capture plan (once, at the first step), end
    store = str(tmp_path / "store")
    assert "every training step" in lines[0] and store in lines[0] and "attribution allowance" in lines[0]
    said = re.search(r"(\d+) checkpoint pass\(es\) of at most (\d+) validation and (\d+) training samples", lines[0])
    assert said is not None and "after epoch(s) 1 " in lines[0], lines[0]
    stored = open_store(store)  # the pass the line announced, as the store holds it
    assert int(said[1]) == 1 and len(stored.sample_ids("epoch-0/val")) <= int(said[2])
    assert 0 < len(stored.sample_ids("epoch-0/train")) <= int(said[3])
    assert lines[1].startswith("MetaStoreCallback: capture plan: policy 'auto'") and "training steps:" in lines[1]
    assert f"reports in {store}/reports" in lines[2] and f"metastore inspect {store}" in lines[2]
    assert f"tensorboard --logdir {trainer.logger.log_dir}" in lines[2]
