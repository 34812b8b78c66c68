"""Where the time after the training steps goes: the callback's ``seconds`` (checkpoint passes, the reports'
exact recomputation), the end-of-training line and ``phase_seconds`` say the same figures."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from lightning_cases import CLASSES, D_IN, Classifier, fit, loaders
from torch import nn

from metastore_plugins import MetaStoreCallback, phase_seconds


class Wide(Classifier):
    """A hidden layer wide enough that a small budget keeps it projected (the reports then refine exactly)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D_IN, 256), nn.Tanh(), nn.Linear(256, CLASSES))


def test_pass_and_report_seconds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train, val = loaders()
    # projected passes, TracIn: the reports refine exactly (EK-FAC, auto's choice there, is not refined)
    callback = MetaStoreCallback(tmp_path / "store", budget="360KB", influence_method="tracin")
    with caplog.at_level(logging.INFO):
        fit(tmp_path, Wide(), train, val, [callback], max_epochs=2)
    end = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MetaStoreCallback: store")][-1]
    phases = phase_seconds(callback.seconds, callback.report_result)
    assert phases["pass_seconds"] > 0 and phases["report_seconds"] > 0
    assert 0 < phases["refine_seconds"] < phases["report_seconds"]  # recomputation is part of the reports
    built = re.search(r"built in ([\d.]+) s, of which ([\d.]+) s recomputing samples exactly", end)
    passes = re.search(r"checkpoint passes took ([\d.]+) s", end)
    assert built is not None and passes is not None, end
    assert float(built[1]) == pytest.approx(phases["report_seconds"], abs=0.051)
    assert float(built[2]) == pytest.approx(phases["refine_seconds"], abs=0.051)
    assert float(passes[1]) == pytest.approx(phases["pass_seconds"], abs=0.051)


def test_the_reports_leave_no_shard_bytes_in_the_trainers_process(tmp_path: Path) -> None:
    """The reports read every shard through the process-wide cache; after them the cache holds nothing."""
    from metastore_plugins.core.store.reading.readcache import SHARDS

    train, val = loaders()
    callback = MetaStoreCallback(tmp_path / "store")
    reads_before = SHARDS.reads
    fit(tmp_path, Wide(), train, val, [callback], max_epochs=1)
    assert callback.report_result is not None and SHARDS.reads > reads_before  # the reports did read shards
    assert SHARDS.nbytes == 0
