"""The HF callback says, in one line at the start and one at the end, where the store and reports went and how
to open them, and why there is no influence report when no evaluation ran during training."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_cases import make_dataset, make_model, train

from metastore_plugins import MetaStoreTrainerCallback
from metastore_plugins import hf_callback as hf_module


class RecordingLogger:
    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {"info": [], "warning": []}

    def info(self, message: str) -> None:
        self.lines["info"].append(message)

    def warning(self, message: str) -> None:
        self.lines["warning"].append(message)


@pytest.mark.parametrize("strategy", ["epoch", "no"])
def test_start_and_end_lines_and_the_missing_influence_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    logger = RecordingLogger()
    monkeypatch.setattr(hf_module, "logger", logger)
    callback = MetaStoreTrainerCallback(tmp_path / "store")
    train(tmp_path, make_model(), make_dataset(16, 1), make_dataset(8, 2), [callback], eval_strategy=strategy)
    store, info = str(tmp_path / "store"), logger.lines["info"]
    assert len(info) == 3  # start, the capture plan (once, at the first step), end
    assert store in info[0] and "evaluation(s)" in info[0]
    assert info[1].startswith("MetaStoreTrainerCallback: capture plan: policy 'auto'")
    assert f"reports in {store}/reports" in info[2] and "tensorboard --logdir" in info[2]
    no_influence = [line for line in logger.lines["warning"] if "no influence report" in line]
    assert len(no_influence) == (1 if strategy == "no" else 0)
    assert callback.report_result is not None
    assert bool(callback.report_result["influence"]) == (strategy == "epoch")
