"""The influence table: per test sample, its strongest proponents and opponents among the training samples.

Rows are plain dicts (JSON-ready), each saying which method produced its scores and whether they are
exact (:func:`passes_exact`); :mod:`~metastore_plugins.core.reports.files` writes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.index_methods import report_index
from metastore_plugins.core.analysis.method_table import AUTO, TRACIN, MethodArgs, check_arguments
from metastore_plugins.core.analysis.methods import METHODS, ResolvedMethod, resolve_method
from metastore_plugins.core.analysis.refine import RecomputeFn, RefinedScores, refine_influence
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.model.pass_sources import TRAIN_SPLIT
from metastore_plugins.core.records import EXACT_KINDS
from metastore_plugins.core.reports.influence_method import method_fields
from metastore_plugins.core.reports.tables import last_metadata


def influence_rows(
    store: GradientStore,
    train: Sequence[str],
    test: Sequence[str],
    k: int = 5,
    samples: int | None = None,
    recompute: RecomputeFn | None = None,
    index: bool | None = None,
    method: str | ResolvedMethod = TRACIN,
    damping: float | None = None,
    relative_damping: float | None = None,
    layers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Per test sample: its label/prediction and the ``k`` strongest proponents and opponents by ``method``.

    ``method``: one of :func:`~metastore_plugins.core.analysis.methods.method_choices` (``"auto"``: EK-FAC
    where every layer of the passes can be preconditioned, else TracIn; ``resolve_method``), or the method a
    caller resolved already, with its ``damping`` and ``relative_damping`` (``store.influence``'s). Each row says
    what produced it (:func:`~.influence_method.method_fields`) and whether its scores are ``"exact"``.

    ``layers``: score on these layers only (every layer when ``None``), as ``store.influence(layers=...)``.

    ``samples``: only the test samples with the ``samples`` smallest ids (all when ``None``);
    the cost grows with train x test pairs, and a report shows a handful.

    ``index``: ``True`` scores only each test sample's candidates from the store's nearest-gradient index (built
    when missing), ``False`` every training row (the reference); ``None`` (default; the reports) is, for TracIn,
    ``True`` from :data:`~metastore_plugins.core.analysis.index_methods.INDEX_ROWS` training rows and below it a kept
    index (``RunCapture(index=True)`` builds it at the run's close), every row for the other methods
    (:func:`~metastore_plugins.core.analysis.index_methods.report_index`). The candidates are scored exactly by
    the method, as ``store.influence(k=...)`` does: the top lists are the exhaustive scan's where the candidates
    hold them (docs/queries.md measures it). A method's scores are exact where its entry says so and the passes
    hold exact records (K-FAC / EK-FAC: given the fitted curvature; TRAK's sketches are estimates). Estimates of a
    method that takes ``recompute`` (TracIn) are refined when it is given: each test sample's candidates are
    recomputed exactly (:func:`~metastore_plugins.core.analysis.refine.refine_influence`); the other methods are
    not refined (the refinement recomputes TracIn).
    """
    chosen = method if isinstance(method, ResolvedMethod) else resolve_method(store, method, [*train, *test], layers)
    method_of = chosen.entry
    check_arguments(method_of, MethodArgs(damping, relative_damping))
    test_ids = first_ids(store, test, samples)
    index = report_index(store, train, chosen.method, index)
    top_k: dict[str, Any] = {} if index is False else {"k": k, "index": index}
    damped = method_of.damping_options(damping, relative_damping)
    scores = store.influence(
        list(train), list(test), test_ids=test_ids, method=chosen.method, layers=chosen.layers_or(layers),
        **damped, **top_k,
    )  # fmt: skip
    exact = method_of.exact and passes_exact(store)
    if not exact and "recompute" in method_of.takes:
        scores = _refined(store, scores, train, test, recompute if layers is None else None)
    fields = method_fields(chosen, damping, relative_damping)
    return _rows(store, scores, k, train, test, exact, fields)


def default_rows(
    store: GradientStore,
    test: Sequence[str],
    k: int = 5,
    *,
    test_ids: Sequence[int] | None = None,
    method: str = AUTO,
    damping: float | None = None,
    relative_damping: float | None = None,
    layers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """:func:`influence_rows` over every training sample the store holds: the default answer
    (``store.influence(test=...)`` with ``train`` left out: the training steps, with the passes' training samples
    where they hold them; :func:`~metastore_plugins.core.analysis.default_answer.default_influence`), for the test
    samples ``test_ids`` (all when None). Each row says the method of the steps' side (else the passes') and
    ``train_side``; its scores are not refined."""
    scores = store.influence(
        test=list(test), method=method, test_ids=test_ids, damping=damping, relative_damping=relative_damping,
        layers=layers,
    )  # fmt: skip
    chosen = getattr(scores, "methods", {})
    name = chosen.get("steps", chosen.get("passes", TRACIN))
    ran_with, relative = METHODS[name].ran_with(damping, relative_damping)
    fields = {"method": name, "damping": ran_with, "relative_damping": relative}
    fields["train_side"] = getattr(scores, "train_side", "")
    exact = METHODS[name].exact and all_exact(store)
    points = [p for p in store.capture_points() if p.endswith(f"/{TRAIN_SPLIT}")] + [TRAINING_STEPS]
    return _rows(store, scores, k, points, test, exact, fields)


def first_ids(store: GradientStore, test: Sequence[str], samples: int | None) -> list[int] | None:
    """The ``samples`` smallest test ids of the last test point (None: every one)."""
    return None if samples is None else sorted(set(store.sample_ids(test[-1]).tolist()))[:samples]


def _rows(
    store: GradientStore,
    scores: Scores,
    k: int,
    train: Sequence[str],
    test: Sequence[str],
    exact: bool,
    fields: dict[str, Any],
) -> list[dict[str, Any]]:
    """The table's rows from ``scores``: per test sample its ``k`` proponents and opponents, labelled from the
    metadata of ``train`` and ``test``, with ``fields`` (what produced them)."""
    train_meta, test_meta = last_metadata(store, train), last_metadata(store, test)
    rows = []
    for entry in scores.top(k):
        sid = entry["sample_id"]
        rows.append(
            {
                "test_id": sid,
                **{f"test_{key}": value for key, value in test_meta[sid].items()},
                "proponents": [
                    {"sample_id": i, "score": s, "label": train_meta[i]["label"]} for i, s in entry["proponents"]
                ],
                "opponents": [
                    {"sample_id": i, "score": s, "label": train_meta[i]["label"]} for i, s in entry["opponents"]
                ],
                "exact": entry.get("exact", exact),
                **fields,
            }
        )
    return rows


def _refined(
    store: GradientStore, scores: Scores, train: Sequence[str], test: Sequence[str], recompute: RecomputeFn | None
) -> RefinedScores:
    """``scores`` recomputed exactly on each test sample's candidates where ``recompute`` is given (the refinement
    recomputes every layer), else as they are; estimates still where recomputing fails."""
    if recompute is not None:
        try:
            return refine_influence(store, scores, list(train), list(test), recompute)
        except Exception as exc:  # the user's model, data or a missing snapshot: keep the estimates
            warnings.warn(f"influence scores stay estimates: recomputing them exactly failed ({exc!r})", stacklevel=3)
    return RefinedScores(scores.scores, scores.row_ids, scores.col_ids, None)


def passes_exact(store: GradientStore) -> bool:
    """Whether every record the checkpoint passes hold is exact: what the shards hold, not what was planned
    (a budget may have degraded a pass planned exact while the run went on)."""
    return all_exact(store, [p for p in store.capture_points() if p != TRAINING_STEPS])


def all_exact(store: GradientStore, points: Sequence[str] | None = None) -> bool:
    """Whether every record of ``points`` (every capture point when None) is exact, as the shards hold it."""
    points = store.capture_points() if points is None else points
    return all(r["kind"] in EXACT_KINDS for p in points for ref in store.batch_refs(p) for r in ref.info["records"])
