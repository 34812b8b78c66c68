"""Both callbacks take the shared settings once declared (training/options.py), and refuse what they do not know."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from metastore_plugins import MetaStoreCallback, MetaStoreTrainerCallback
from metastore_plugins.core.training.settings import CaptureSettings


@pytest.mark.parametrize("callback", [MetaStoreCallback, MetaStoreTrainerCallback])
def test_an_unknown_setting_is_named(callback: type) -> None:
    with pytest.raises(TypeError, match=rf"{callback.__name__}\(\) got unexpected setting\(s\) 'encodng'"):
        callback(encodng="fp16")


@pytest.mark.parametrize("callback", [MetaStoreCallback, MetaStoreTrainerCallback])
def test_shared_settings_reach_the_options_and_the_schedule(callback: type) -> None:
    made = callback(encoding="int8", checkpoint_train_samples=7, checkpoint_val_samples=5, seed=3, report_k=4)
    assert (made.options.encoding, made.options.report_k) == ("int8", 4)
    assert (made.schedule.train_samples, made.schedule.val_samples, made.schedule.seed) == (7, 5, 3)
    assert made.schedule.train_subset(100) == made.schedule.train_subset(100)
    assert len(made.schedule.train_subset(100)) == 7


@pytest.mark.parametrize("callback", [MetaStoreCallback, MetaStoreTrainerCallback])
def test_every_shared_setting_is_documented_on_each_callback(callback: type) -> None:
    doc = callback.__doc__ or ""
    assert "{settings}" not in doc
    for name in CaptureSettings.__annotations__:
        assert f"        {name}: " in doc, name


@pytest.mark.parametrize("callback", [MetaStoreCallback, MetaStoreTrainerCallback])
def test_flush_seconds_reach_the_store_writer(callback: type, tmp_path: Path) -> None:
    assert callback().options.flush_seconds == 10.0
    for value in (2, None):
        run = callback(flush_seconds=value).options.run_capture(tmp_path, rank=0, loss_reduction="mean", config={})
        run.close()
        assert run.writer.flush_seconds == value
    for wrong in (0, -1.0, math.inf, "5"):
        with pytest.raises(ValueError, match=rf"{callback.__name__}\(flush_seconds=\.\.\.\) must be a positive"):
            callback(flush_seconds=wrong)
