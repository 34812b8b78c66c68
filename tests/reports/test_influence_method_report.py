"""The influence report by ``influence_method``: EK-FAC on exact factors by default, TracIn (said, with why) where
the passes are projected, and every row and caption naming the method, its damping and how exact it is.

References: the rankings against ``store.kfac_influence`` / ``store.influence`` of the same store up to ties
(``assert_top_ranking``; the scores themselves are tested against torch.func references in
tests/store_queries/test_influence_methods.py); what ``auto`` picks against the store's record kinds as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from methodcases import TRAIN, VAL, write_passes
from reportcases import assert_top_ranking

from metastore_plugins import open_store
from metastore_plugins.core.analysis import GradientStore, Scores
from metastore_plugins.core.reports import write_reports
from metastore_plugins.core.training.report_pass import build_reports
from metastore_plugins.core.training.settings import CallbackOptions


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    return open_store(write_passes(tmp_path_factory.mktemp("exact") / "store"))


@pytest.fixture(scope="module")
def projected(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    return open_store(write_passes(tmp_path_factory.mktemp("projected") / "store", projected=True))


def assert_rows_rank(rows: list[dict], scores: Scores) -> None:
    tol = 1e-6 * float(np.abs(scores.scores).max())
    assert [row["test_id"] for row in rows] == scores.col_ids.tolist()
    for j, row in enumerate(rows):
        ranking = list(zip(scores.row_ids.tolist(), scores.scores[:, j].tolist()))
        assert_top_ranking([(p["sample_id"], p["score"]) for p in row["proponents"]], ranking, tol)
        negated = [(i, -s) for i, s in ranking]
        assert_top_ranking([(p["sample_id"], -p["score"]) for p in row["opponents"]], negated, tol)


def test_auto_is_ekfac_on_exact_factors(exact: GradientStore, tmp_path: Path) -> None:
    written = write_reports(exact, tmp_path)
    rows = json.loads((tmp_path / "influence.json").read_text())
    assert rows == json.loads(json.dumps(written["influence"]))  # what the call returned, as written
    assert {(r["method"], r["damping"], r["relative_damping"], r["exact"]) for r in rows} == {
        ("ekfac", None, 0.1, True)
    }
    assert not any("method_note" in row for row in rows)
    assert_rows_rank(rows, exact.kfac_influence(TRAIN, VAL, method="ekfac"))
    text = (tmp_path / "influence.md").read_text()
    assert "Method: EK-FAC, damping 0.1 x each layer's mean curvature eigenvalue." in text
    assert "Scores are exact given the fitted curvature" in text


def test_auto_falls_back_to_tracin_on_projected_records_and_says_why(projected: GradientStore, tmp_path: Path) -> None:
    write_reports(projected, tmp_path)
    rows = json.loads((tmp_path / "influence.json").read_text())
    assert {(r["method"], r["damping"], r["relative_damping"], r["exact"]) for r in rows} == {
        ("tracin", None, None, False)
    }
    assert all("'epoch-0/train'" in row["method_note"] and "projected" in row["method_note"] for row in rows)
    assert_rows_rank(rows, projected.influence(TRAIN, VAL))
    text = (tmp_path / "influence.md").read_text()
    assert "Method: TracIn" in text and "auto chose it because K-FAC cannot precondition 'epoch-0/train'" in text
    assert "Scores are estimates from projected gradients" in text


def test_auto_is_ekfac_on_passes_projected_on_the_eigenbasis_and_says_they_are_estimates(tmp_path: Path) -> None:
    store = open_store(write_passes(tmp_path / "store", projected=True, eigenbasis=True))
    kinds = {r["kind"] for cp in TRAIN + VAL for ref in store.batch_refs(cp) for r in ref.info["records"]}
    assert kinds == {"projected"}  # as written: every record projected, none exact
    write_reports(store, tmp_path / "reports", recompute=refuse)
    rows = json.loads((tmp_path / "reports" / "influence.json").read_text())
    assert {(r["method"], r["relative_damping"], r["exact"]) for r in rows} == {("ekfac", 0.1, False)}
    assert_rows_rank(rows, store.kfac_influence(TRAIN, VAL, method="ekfac"))
    text = (tmp_path / "reports" / "influence.md").read_text()
    assert "Method: EK-FAC" in text and "Scores are estimates from projected gradients" in text
    assert "the exact refinement (recompute) recomputes TracIn and is not applied to them" in text


def refuse(split: str, ids: object, checkpoint: str) -> list:
    raise AssertionError("the refinement recomputes TracIn: EK-FAC rows are never refined")


@pytest.mark.parametrize(
    ("method", "fields", "words"),
    [
        ("tracin", ("tracin", None, None, True), ["Method: TracIn", "Scores are exact TracIn scores."]),
        ("kfac", ("kfac", None, 0.1, True), ["Method: K-FAC, damping 0.1 x", "exact given the fitted curvature"]),
        ("trak", ("trak", None, 1.0, False), ["Method: TRAK", "ridge 1 x", "Scores are estimates", "not applied"]),
    ],
)
def test_a_chosen_method_is_said(
    exact: GradientStore, tmp_path: Path, method: str, fields: tuple, words: list[str]
) -> None:
    write_reports(exact, tmp_path, influence_method=method)
    rows = json.loads((tmp_path / "influence.json").read_text())
    assert {(r["method"], r["damping"], r["relative_damping"], r["exact"]) for r in rows} == {fields}
    reference = exact.influence(TRAIN, VAL, method=method)  # type: ignore[arg-type]
    assert_rows_rank(rows, reference)
    text = (tmp_path / "influence.md").read_text()
    assert all(word in text for word in words), text[-600:]


def test_an_explicit_curvature_method_on_projected_records_is_refused_by_name(
    projected: GradientStore, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="of layer '.'.*projected"):
        write_reports(projected, tmp_path, influence_method="ekfac")


def test_the_setting_is_checked_against_the_one_tuple() -> None:
    with pytest.raises(ValueError, match=r"MetaStoreCallback\(influence_method=...\) must be one of auto, tracin"):
        CallbackOptions.of("MetaStoreCallback", {"influence_method": "best"})  # type: ignore[typeddict-item]
    assert CallbackOptions.of("MetaStoreCallback", {}).influence_method == "auto"


def test_the_callbacks_setting_reaches_the_report_pass(tmp_path: Path) -> None:
    store_dir = write_passes(tmp_path / "store")
    options = CallbackOptions.of("MetaStoreCallback", {"influence_method": "kfac"})
    result = build_reports(options, store_dir, [], step=0)
    assert result is not None and {row["method"] for row in result.influence or []} == {"kfac"}
    rows = json.loads((store_dir / "reports" / "influence.json").read_text())
    assert rows and {(row["method"], row["relative_damping"]) for row in rows} == {("kfac", 0.1)}
