"""Checks of a partitioned report pass against one process (tests/distributed, tests/lightning, tests/hf).

:func:`assert_tables_match` compares the outlier and influence rows a distributed pass wrote with
the single-process ones, up to fp32 round-off (``1e-6`` of the largest reference value) and ties
(``assert_top_ranking``, as ``tests/store_queries/runcases.py``); :func:`assert_shares` checks the
``report_result["partition"]`` of every rank: the same queries, each row scored by exactly one rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins import open_store
from metastore_plugins.core.reports.tables import checkpoint_points, outlier_points, outlier_scores, self_influence_of

RTOL = 1e-6


def assert_top_ranking(got: list[tuple[Any, float]], ranking: list[tuple[Any, float]], tol: float) -> None:
    """``got`` (key, value) pairs, largest first, are a top ``len(got)`` of ``ranking`` up to ties within ``tol``."""
    reference = dict(ranking)
    keys = [key for key, _ in got]
    assert len(set(keys)) == len(keys), keys
    for key, value in got:
        assert key in reference, key
        assert abs(value - reference[key]) <= tol, (key, value, reference[key])
    values = [value for _, value in got]
    assert all(a >= b - tol for a, b in zip(values, values[1:])), values  # largest first
    cut = min(values)
    assert all(value <= cut + tol for key, value in ranking if key not in keys)  # nothing larger left out


def read_tables(reports_dir: Path) -> dict[str, Any]:
    """The ``outliers`` and ``influence`` rows of a reports directory."""
    return {name: json.loads((reports_dir / f"{name}.json").read_text()) for name in ("outliers", "influence")}


def assert_tables_match(store_dir: Path, got: dict[str, Any], alone: dict[str, Any]) -> None:
    """``got``'s rows (a partitioned pass) rank as ``alone``'s (one process) and as the store's own scores."""
    store = open_store(store_dir)
    points = checkpoint_points(store, "train")
    sources = outlier_points(store, points, "auto")  # the reports' default: the training steps where captured
    si_ids, si = self_influence_of(store, sources)
    ranked = outlier_scores(store, sources, "auto", (si_ids, si))
    score_of = dict(zip(ranked.ids.tolist(), ranked.score.tolist()))
    tol = RTOL * float(np.nanmax(np.abs(ranked.score)))
    assert len(got["outliers"]) == len(alone["outliers"])
    assert_top_ranking(
        [(r["sample_id"], score_of[r["sample_id"]]) for r in got["outliers"]], list(score_of.items()), tol
    )
    reference = dict(zip(si_ids.tolist(), si.tolist()))
    for row in got["outliers"]:
        if row["self_influence"] is not None:
            assert abs(row["self_influence"] - reference[row["sample_id"]]) <= RTOL * float(si.max())
    assert [r["test_id"] for r in got["influence"]] == [r["test_id"] for r in alone["influence"]]
    if not got["influence"]:
        return
    method = alone["influence"][0]["method"]  # the report's influence_method="auto": EK-FAC or TracIn
    tests = sorted(checkpoint_points(store, "val"), key=lambda p: store.steps(p)[0])
    if alone["influence"][0].get("train_side"):  # the default answer: every training sample, these test ids
        full = store.influence(test=tests, method="auto", test_ids=[r["test_id"] for r in alone["influence"]])
    else:
        full = store.influence(points, tests, method=method)
    tol = RTOL * float(np.abs(full.scores).max())
    for row, want in zip(got["influence"], alone["influence"]):
        assert row["exact"] == want["exact"]
        column = full.scores[:, full.col_ids.tolist().index(row["test_id"])]
        ranking = list(zip(full.row_ids.tolist(), column.tolist()))
        assert_top_ranking([(p["sample_id"], p["score"]) for p in row["proponents"]], ranking, tol)
        negated = [(i, -s) for i, s in ranking]
        assert_top_ranking([(p["sample_id"], -p["score"]) for p in row["opponents"]], negated, tol)


def assert_shares(shares: Sequence[dict[str, Any]]) -> None:
    """Every rank made the same partitioned queries, each row scored by one rank, and rank 1 scored some."""
    assert [s["rank"] for s in shares] == list(range(len(shares))) and {s["world"] for s in shares} == {len(shares)}
    names = [[q["query"] for q in s["queries"]] for s in shares]
    assert all(n == names[0] for n in names), names  # the same collectives in the same order
    assert any(n.startswith("self_influence") for n in names[0]) and any(n.startswith("influence") for n in names[0])
    for queries in zip(*(s["queries"] for s in shares)):
        assert len({q["total"] for q in queries}) == 1 and sum(q["rows"] for q in queries) == queries[0]["total"]
    assert all(s["rows"] > 0 for s in shares), shares
