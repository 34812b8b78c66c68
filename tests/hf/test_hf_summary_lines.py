"""The HF callback says, in one line at the start and one at the end, where the store and reports went and how
to open them, and why there is no influence report when no evaluation ran during training."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hf_cases import make_dataset, make_model, train

from metastore_plugins import MetaStoreTrainerCallback
from metastore_plugins import hf_callback as hf_module


class RecordingLogger:
    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {"info": [], "warning": []}

    def log(self, level: int, message: str) -> None:
        self.lines[logging.getLevelName(level).lower()].append(message)

    def info(self, message: str) -> None:
        self.log(logging.INFO, message)

    def warning(self, message: str) -> None:
        self.log(logging.WARNING, message)


@pytest.mark.parametrize("strategy", ["epoch", "no"])
def test_start_and_end_lines_and_the_missing_influence_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    logger = RecordingLogger()
    monkeypatch.setattr(hf_module, "logger", logger)
    callback = MetaStoreTrainerCallback(tmp_path / "store")
    train(tmp_path, make_model(), make_dataset(16, 1), make_dataset(8, 2), [callback], eval_strategy=strategy)
    store, info = str(tmp_path / "store"), logger.lines["info"]
    assert len(info) == 1  # the capture plan (once, at the first step)
    assert info[0].startswith("MetaStoreTrainerCallback: capture plan: policy 'auto'")
    said = [line for line in logger.lines["warning"] if "no influence report" not in line]
    assert len(said) == 2  # start, end: at warning level by default (log_level="passive"), so that they show
    assert store in said[0] and "evaluation(s)" in said[0]
    assert f"reports in {store}/reports" in said[1] and "tensorboard --logdir" in said[1]
    no_influence = [line for line in logger.lines["warning"] if "no influence report" in line]
    assert len(no_influence) == (1 if strategy == "no" else 0)
    assert callback.report_result is not None
    assert bool(callback.report_result["influence"]) == (strategy == "epoch")
