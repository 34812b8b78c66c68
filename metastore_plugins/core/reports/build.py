"""The outlier and influence reports of a store: their rows (:func:`report_tables`) and files (:func:`write_tables`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from typing_extensions import Unpack

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.method_table import AUTO
from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.capture.batch_mixing import batch_mixed_note
from metastore_plugins.core.errors import MetastoreError, QueryError
from metastore_plugins.core.reports.files import (
    REPORTS_ELSEWHERE,
    RenderFn,
    influence_markdown,
    open_reports,
    write_table,
    write_text,
)
from metastore_plugins.core.reports.influence_table import default_rows, first_ids, influence_rows
from metastore_plugins.core.reports.stored import (
    budget_caption,
    budget_notes,
    default_test_points,
    dropped_message,
    outlier_ranking,
    stored_self_influence,
    with_gradients,
)
from metastore_plugins.core.reports.tables import (
    OUTLIER_COLUMNS,
    Scores,
    checkpoint_points,
    outlier_markdown,
    outlier_points,
    outlier_table,
)
from metastore_plugins.core.store.writable import writing

#: test samples in the influence report by default (those with the smallest ids)
INFLUENCE_SAMPLES = 16


class ReportOptions(TypedDict, total=False):
    """The keyword options of :func:`write_reports`, those of :func:`report_tables` (defaults there)."""

    train_split: str
    test_split: str
    k: int
    render: RenderFn | None
    scores: Scores | None
    influence_samples: int | None
    outliers_from: str
    recompute: RecomputeFn | None
    rank_outliers_by: str
    influence_method: str


def write_reports(store: GradientStore, directory: str | Path, **options: Unpack[ReportOptions]) -> dict[str, Any]:
    """Build the outlier and influence reports from the checkpoint passes and write them to ``directory``.

    ``options``: those of :func:`report_tables`. Returns what was written (:func:`write_tables`):
    ``{"outliers": rows, "influence": rows, "files": [paths], "outlier_columns": columns,
    "outlier_caption": lines}``.
    """
    return write_tables(store, directory, report_tables(store, **options))


def report_tables(
    store: GradientStore,
    *,
    train_split: str = "train",
    test_split: str = "val",
    k: int = 20,
    render: RenderFn | None = None,
    scores: Scores | None = None,
    influence_samples: int | None = INFLUENCE_SAMPLES,
    outliers_from: str = "auto",
    recompute: RecomputeFn | None = None,
    rank_outliers_by: str = "auto",
    influence_method: str = AUTO,
) -> dict[str, Any]:
    """The outlier and influence rows of the checkpoint passes, as :func:`write_tables` writes them.

    ``{"outliers", "influence", "outlier_columns", "outlier_caption"}``.

    With ``render``, outlier rows get a ``text`` column and influence rows ``test_text`` and
    the ``text`` of each proponent and opponent. ``scores``: the training samples'
    ``(ids, self-influence)`` when already computed (:func:`~.tables.self_influence_of`).
    ``influence_samples``: the influence report covers the test samples with the smallest
    ids, this many (``None``: all of them, at a cost that grows with train x test pairs).
    ``outliers_from``: where self-influence is summed, ``"auto"``, ``"checkpoints"`` or ``"training"``
    (:func:`~.tables.outlier_points`). ``rank_outliers_by``: ``"auto"`` (AUM where the training
    steps hold margins, else self-influence), ``"aum"``, ``"loss"`` or ``"self_influence"``
    (:func:`~.tables.outlier_scores`).
    The influence table: with ``influence_method="auto"`` (default), every training sample the store holds where
    the training steps hold inner products (the default answer, EK-FAC where every layer can be preconditioned,
    else TracIn: :func:`~.influence_table.default_rows`); else (or with another method of
    :func:`~metastore_plugins.core.analysis.methods.method_choices`) the checkpoint passes' training samples
    (:func:`~.influence_table.influence_rows`, ``auto`` there as on the passes; ``recompute`` refines estimated
    TracIn scores exactly).

    Its store queries are those a partitioned report pass makes on every rank, in this order:
    ``self_influence`` (unless ``scores`` is given), then one ``influence``.
    """
    train, test = checkpoint_points(store, train_split), checkpoint_points(store, test_split)
    if not train and TRAINING_STEPS not in store.capture_points():
        raise QueryError(
            f"the store has no checkpoint passes 'epoch-*/{train_split}' or 'step-*/{train_split}' and no training "
            f"steps; it has {store.capture_points()}" + (f": {dropped_message(store)}" if budget_notes(store) else "")
        )
    sources = outlier_points(store, train, outliers_from)  # what the budget kept as metadata only is used as such
    scores = scores if scores is not None else stored_self_influence(store, sources)
    table = outlier_table(store, sources, k, scores, outlier_ranking(store, sources, rank_outliers_by))
    notes = budget_notes(store)
    outliers, caption = table.rows, budget_caption(store, table.caption, len(scores[0]))
    caption += batch_mixed_note(store.config).values()  # layers below a training BatchNorm
    columns: tuple[str, ...] = OUTLIER_COLUMNS
    if render is not None:
        for row in outliers:
            row["text"] = render(train_split, row["sample_id"])
        columns = (*OUTLIER_COLUMNS, "text")
    pairs = [(a, a.split("/")[0] + "/" + test_split) for a in train if a.split("/")[0] + "/" + test_split in test]
    pairs = [(a, b) for a, b in pairs if len(with_gradients(store, (a, b), inner=True)) == 2]
    influence: list[dict[str, Any]] | None = None
    if influence_method == AUTO:  # every training sample (an explicit method: the passes', by it)
        influence = _default_table(store, test, influence_samples, caption)
    if influence is None and pairs:
        influence = influence_rows(
            store,
            [a for a, _ in pairs],
            [b for _, b in pairs],
            k=5,
            samples=influence_samples,
            recompute=recompute,
            method=influence_method,
        )
    elif influence is None and (test or notes):
        caption.append("No influence report: no checkpoint pass holds train and test gradients with inner products.")
    if render is not None and influence is not None:
        for row in influence:
            row["test_text"] = render(test_split, row["test_id"])
            for entry in (*row["proponents"], *row["opponents"]):
                entry["text"] = render(train_split, entry["sample_id"])
    return {"outliers": outliers, "influence": influence, "outlier_columns": columns, "outlier_caption": caption}


def _default_table(
    store: GradientStore, test: list[str], samples: int | None, caption: list[str]
) -> list[dict[str, Any]] | None:
    """The influence rows of the default answer (every training sample) where the training steps hold inner
    products; None (the passes' table) where they do not, or where the answer cannot pair them (said in
    ``caption``)."""
    tests = default_test_points(store, test)
    if not tests:
        return None
    try:
        return default_rows(store, tests, 5, test_ids=first_ids(store, tests, samples))
    except MetastoreError as exc:  # steps the passes cannot be paired with (a tagged range kept otherwise)
        caption.append(
            f"Influence over the checkpoint passes' training samples: the training steps could not be paired ({exc})."
        )
        return None


def write_tables(store: GradientStore, directory: str | Path, tables: dict[str, Any]) -> dict[str, Any]:
    """Write :func:`report_tables`'s rows and the store's summary into ``directory``; returns them with ``"files"``.

    ``tables["influence"] is None`` (no test passes): no influence files.
    """
    with writing(Path(directory), REPORTS_ELSEWHERE), open_reports(store.path, directory) as out:  # never a link
        files = write_table(out, "outliers", tables["outliers"], tables["outlier_columns"])
        caption = tables.get("outlier_caption", [])  # what ranks the rows and where each column comes from
        write_text(out, "outliers.md", outlier_markdown(tables["outliers"], tables["outlier_columns"], caption))
        influence = tables["influence"]
        if influence is not None:
            files.append(write_text(out, "influence.json", json.dumps(influence, indent=1)))
            files.append(write_text(out, "influence.md", influence_markdown(influence)))
        files.append(
            write_text(out, "summary.json", json.dumps({**store.summary(), **batch_mixed_note(store.config)}, indent=1))
        )
    return {**tables, "influence": influence or [], "files": [str(p) for p in files]}
