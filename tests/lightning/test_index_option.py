"""The callbacks' ``index=`` setting: RunCapture builds the nearest-gradient index when training ends, before the
reports, and the reports' TracIn proponents/opponents come through it.

References: the order of the build and the influence table (spied), every capture point's kept index whole
(nothing left to build), and the report's rows against ``influence_rows(index=False)`` (every row scored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lightning_cases import Classifier, fit, loaders

from metastore_plugins import MetaStoreCallback, MetaStoreTrainerCallback, open_store
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.reports import build
from metastore_plugins.core.reports.influence_table import influence_rows
from metastore_plugins.core.reports.tables import checkpoint_points
from metastore_plugins.core.training import run as run_module


@pytest.mark.parametrize("callback", [MetaStoreCallback, MetaStoreTrainerCallback])
def test_index_reaches_the_run_capture_and_is_checked(callback: type, tmp_path: Path) -> None:
    assert callback().options.index is False
    made = callback(index=True).options.run_capture(tmp_path / "store", rank=0, loss_reduction="mean", config={})
    made.close()
    assert made.index is True and made.index_parts is not None and made.index_parts.written == []  # no shard
    with pytest.raises(ValueError, match=rf"{callback.__name__}\(index=\.\.\.\) must be True or False"):
        callback(index="yes")


def test_a_lightning_run_with_index_builds_it_before_its_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    build_parts, rows_of = run_module.build_rank_parts, build.influence_rows

    def spy_build(*args: Any, **kwargs: Any) -> Any:
        events.append("index")
        return build_parts(*args, **kwargs)

    def spy_rows(*args: Any, **kwargs: Any) -> Any:
        events.append("influence")
        return rows_of(*args, **kwargs)

    monkeypatch.setattr(run_module, "build_rank_parts", spy_build)
    monkeypatch.setattr(build, "influence_rows", spy_rows)
    train, val = loaders(n_train=64, n_val=12)
    callback = MetaStoreCallback(tmp_path / "store", index=True, influence_method="tracin")
    fit(tmp_path, Classifier(), train, val, [callback], max_epochs=2)
    assert events == ["index", "influence"]
    store = open_store(callback.dirpath)
    for point in store.capture_points():  # every shard's part built at the close: nothing left to build
        opened = vi.open_index(store, point, build=False)
        assert opened is not None and opened.rebuilt == [] and len(opened.sample_ids) == len(store.sample_ids(point))
    assert store.verify() == []
    report = callback.report_result
    assert report is not None and report.influence
    reference = influence_rows(
        store, checkpoint_points(store, "train"), checkpoint_points(store, "val"), k=5, method="tracin", index=False
    )
    reference = [r for r in reference if r["test_id"] in {row["test_id"] for row in report.influence}]
    assert len(reference) == len(report.influence)
    for got, want in zip(report.influence, reference):
        assert got["test_id"] == want["test_id"]
        for side in ("proponents", "opponents"):
            assert sorted(e["sample_id"] for e in got[side]) == sorted(e["sample_id"] for e in want[side])
            np.testing.assert_allclose(
                sorted(e["score"] for e in got[side]), sorted(e["score"] for e in want[side]), rtol=1e-5, atol=1e-9
            )
