"""Both callbacks take the shared settings once declared (training/options.py), and refuse what they do not know."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import numpy as np
import pytest

from metastore_plugins import MetaStoreCallback, MetaStoreTrainerCallback
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.training.settings import SETTINGS, CallbackOptions, CaptureSettings
from metastore_plugins.core.training.settings_doc import SETTINGS_DOC


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


def test_the_typed_settings_are_the_settings_table() -> None:
    """CaptureSettings (what mypy checks a callback's keywords against) is SETTINGS' names and types, in order."""
    assert list(get_type_hints(CaptureSettings).items()) == [(row.name, row.type) for row in SETTINGS]
    assert [f.name for f in fields(CallbackOptions)] == [
        "owner",
        *(row.name for row in SETTINGS),
        "given",
        "capture_budget",
    ]


def test_each_setting_is_documented_checked_and_defaulted_from_its_one_declaration() -> None:
    by_name = {row.name: row for row in SETTINGS}
    for row in SETTINGS:
        assert f"{row.name}: {row.doc.split()[0]}" in SETTINGS_DOC  # the doc text is the row's
    made = CallbackOptions("X")
    assert {row.name: getattr(made, row.name) for row in SETTINGS} == {row.name: row.default for row in SETTINGS}
    checked = {row.name for row in SETTINGS if row.check is not None}
    assert {"per_sample_loss", "labels", "capture_train_steps", "reports"}.isdisjoint(checked)
    for name, wrong in (("report_k", 0), ("encoding", "fp8"), ("index", 1), ("basis_samples", -1), ("policy", "x")):
        assert name in checked
        with pytest.raises(ValueError, match=rf"^X\({name}=\.\.\.\) must "):
            CallbackOptions("X", **{name: wrong})
    assert by_name["seed"].check is not None and CallbackOptions("X", seed=np.int64(-3)).seed == -3


def test_the_budget_is_built_once_and_reaches_the_plan_as_that_object(tmp_path: Path) -> None:
    options = CallbackOptions("X", policy="auto", budget="2MB")
    assert options.capture_budget == Budget("auto", 2_000_000)
    run = options.run_capture(tmp_path, rank=0, loss_reduction="mean", config={})
    run.close()
    assert run.policy.budget is options.capture_budget  # one rank: the settings' own object
    split = options.run_capture(tmp_path / "two", rank=1, world_size=2, loss_reduction="mean", config={})
    split.close()
    assert split.policy.budget == Budget("auto", 1_000_000)
