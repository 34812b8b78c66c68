"""Report tables built from store queries: the suspicious training samples (the outlier table), and the
checkpoint passes and per-sample metadata the reports read.

Rows are plain dicts (JSON-ready); :mod:`~metastore_plugins.core.reports.files` writes them
as JSON, CSV and markdown. The influence table is :mod:`.influence_table`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.signals import TRAINING_STEPS, training_signals
from metastore_plugins.core.errors import ConfigError, QueryError
from metastore_plugins.core.reports.files import markdown_table, one_line, shorten


def checkpoint_points(store: GradientStore, split: str) -> list[str]:
    """Capture points ``epoch-{e}/{split}`` (or ``step-{s}/{split}``) of the checkpoint passes, in order."""

    def key(cp: str) -> tuple[int, int] | None:
        kind, _, number = cp.split("/")[0].partition("-")
        if kind not in ("epoch", "step") or not number.isdigit():
            return None
        return (0 if kind == "epoch" else 1, int(number))

    keyed = [(at, cp) for cp in store.capture_points() if cp.endswith("/" + split) and (at := key(cp)) is not None]
    return [cp for _, cp in sorted(keyed)]


def last_metadata(store: GradientStore, points: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Per sample id: label, prediction and loss from the last capture point that holds it."""
    rows: dict[int, dict[str, Any]] = {}
    for cp in points:
        meta = store.metadata(cp)
        for k, sid in enumerate(meta["sample_id"].tolist()):
            rows[int(sid)] = {
                "label": meta["label"][k].tolist(),  # an int for class labels, a float for regression targets
                "prediction": int(meta["prediction"][k]),
                "loss": float(meta["loss"][k]),
            }
    return rows


#: ``(sample ids, TracIn self-influence)`` of the training samples, both ``(N,)`` (:func:`self_influence_of`)
Scores = tuple[np.ndarray, np.ndarray]

#: where the outlier report takes self-influence from
OutlierSource = Literal["auto", "checkpoints", "training"]
OUTLIER_SOURCES: tuple[str, ...] = get_args(OutlierSource)


def check_outlier_source(outliers_from: str, training_steps: bool, owner: str) -> None:
    """Raise naming ``owner``'s setting when ``outliers_from`` is unknown or has no training steps to rank."""
    if outliers_from not in OUTLIER_SOURCES:
        raise ConfigError(f"{owner}(outliers_from=...) must be one of {OUTLIER_SOURCES}, got {outliers_from!r}")
    if outliers_from == "training" and not training_steps:
        raise ConfigError(
            f"{owner}(outliers_from='training') ranks the captured training steps; keep capture_train_steps=True"
        )


def outlier_points(store: GradientStore, checkpoints: Sequence[str], outliers_from: str) -> list[str]:
    """The capture points the outlier report sums self-influence over.

    ``"checkpoints"``: the training checkpoint passes (every sample at the same weights, the
    samples the passes cover). ``"training"``: the training steps (``sum_t lr_t ||g_i(w_t)||^2``
    over the steps each sample was trained in, TracIn's in-run form: every trained sample,
    no pass needed). ``"auto"``: the training steps where the store holds them, else the passes.
    """
    if outliers_from not in OUTLIER_SOURCES:
        raise ConfigError(f"outliers_from must be one of {OUTLIER_SOURCES}, got {outliers_from!r}")
    if outliers_from == "auto":
        outliers_from = "training" if TRAINING_STEPS in store.capture_points() else "checkpoints"
    if outliers_from == "checkpoints":
        return list(checkpoints)
    if TRAINING_STEPS not in store.capture_points():
        raise QueryError(
            f"outliers_from='training' needs the training steps (capture point {TRAINING_STEPS!r}), and the store "
            f"holds {store.capture_points()}; keep capture_train_steps=True or use outliers_from='checkpoints'"
        )
    return [TRAINING_STEPS]


def self_influence_of(store: GradientStore, points: Sequence[str]) -> Scores:
    """``(sample ids, TracIn self-influence)``, both ``(N,)``, ids in first-seen order.

    ``sum lr ||g_i||^2`` over every occurrence of each sample in the capture points
    ``points``: once per checkpoint pass, or once per epoch in the training steps.
    """
    ids = np.concatenate([store.sample_ids(point) for point in points])  # (occurrences,)
    values = np.concatenate([store.self_influence(point) for point in points])  # (occurrences,)
    unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    total = np.zeros(len(unique))
    np.add.at(total, inverse, values)
    order = np.argsort(first, kind="stable")
    return unique[order], total[order]


#: what ranks the outlier report: ``"auto"`` is AUM where the training steps hold margins, else self-influence
OutlierRanking = Literal["auto", "aum", "loss", "self_influence"]
OUTLIER_RANKINGS: tuple[str, ...] = get_args(OutlierRanking)


@dataclass(frozen=True)
class OutlierScores:
    """Every ranked training sample: ``ids``, the ranking ``score`` (larger: more suspicious) and its parts.

    ``by``: ``"aum"`` (score ``-AUM``), ``"loss"`` or ``"self_influence"``; ``self_influence``,
    ``aum`` and ``last_step_loss`` (the loss at the sample's last training step) are NaN for samples
    without one (not in the passes; no margins or no training steps stored). ``trained``: how many
    samples the training steps hold (None without them).
    """

    ids: np.ndarray  # (N,) int64
    score: np.ndarray  # (N,) float64
    by: str
    self_influence: np.ndarray  # (N,)
    aum: np.ndarray  # (N,)
    last_step_loss: np.ndarray  # (N,)
    trained: int | None


def has_margins(store: GradientStore) -> bool:
    """Whether the store's training steps hold a finite classification margin (for AUM)."""
    if TRAINING_STEPS not in store.capture_points():
        return False
    return bool(np.isfinite(store.metadata(TRAINING_STEPS)["margin"]).any())


def _aligned(ids: np.ndarray, source_ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` of ``source_ids`` at ``ids`` (NaN where a sample has none)."""
    out = np.full(len(ids), np.nan)
    position = {int(sid): k for k, sid in enumerate(source_ids.tolist())}
    for k, sid in enumerate(ids.tolist()):
        if sid in position:
            out[k] = values[position[sid]]
    return out


def outlier_scores(
    store: GradientStore,
    points: Sequence[str],
    rank_by: str = "auto",
    self_influence: Scores | None = None,
) -> OutlierScores:
    """The outlier report's ranking of the training samples (docs/quality.md measures the choice).

    ``"aum"``: every trained sample by its area under the margin over the training steps
    (:mod:`~metastore_plugins.core.analysis.signals`), lowest first: on the digits it finds flipped
    labels better than self-influence, the final loss and cleanlab. ``"loss"``: by the loss at the
    last pass of ``points`` (else the last training step), which does best on a short fine-tune
    of a pretrained model. ``"self_influence"``: the samples of ``points`` by TracIn
    self-influence. ``"auto"``: AUM where the training steps hold margins (classification), else
    self-influence. ``self_influence``: :func:`self_influence_of` over ``points`` when at hand.
    """
    if rank_by not in OUTLIER_RANKINGS:
        raise ConfigError(f"rank_outliers_by must be one of {OUTLIER_RANKINGS}, got {rank_by!r}")
    margins = has_margins(store)
    if rank_by == "aum" and not margins:
        raise QueryError(
            "rank_outliers_by='aum' needs the training steps with their margins (capture_train_steps=True and "
            "class logits); use 'self_influence' or 'auto'"
        )
    si_ids, si_values = self_influence if self_influence is not None else self_influence_of(store, points)
    signals = training_signals(store) if TRAINING_STEPS in store.capture_points() else None
    if rank_by == "loss":
        if (last_pass := _last_pass(points)) is not None:
            last = store.metadata(last_pass)
            ids, score = last["sample_id"].astype(np.int64), last["loss"].astype(np.float64)
        elif signals is not None:
            ids, score = signals.sample_ids, signals.last_loss
        else:
            raise QueryError("rank_outliers_by='loss' needs checkpoint passes or training steps in the store")
    elif rank_by == "self_influence" or not margins:
        ids, score, rank_by = si_ids, si_values, "self_influence"
    else:
        assert signals is not None  # margins are read from the training steps
        ids, score, rank_by = signals.sample_ids, -signals.aum, "aum"
    if signals is None:
        aum, step_loss, trained = np.full(len(ids), np.nan), np.full(len(ids), np.nan), None
    else:
        aum, step_loss = (_aligned(ids, signals.sample_ids, v) for v in (signals.aum, signals.last_loss))
        trained = len(signals.sample_ids)
    return OutlierScores(ids, score, rank_by, _aligned(ids, si_ids, si_values), aum, step_loss, trained)


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


#: the outlier table's columns; each holds one quantity (:func:`outlier_table` says where each comes from)
OUTLIER_COLUMNS = (
    "rank",
    "sample_id",
    "label",
    "pass_prediction",
    "pass_loss",
    "last_step_loss",
    "aum",
    "self_influence",
    "class_zscore",
)


@dataclass(frozen=True)
class OutlierTable:
    """The outlier report: ``rows`` (one dict per sample, keys :data:`OUTLIER_COLUMNS`) and ``caption``: what
    ranks them, over which samples, and where each column comes from (blank cells: a sample without it)."""

    rows: list[dict[str, Any]]
    caption: list[str]


def _last_pass(points: Sequence[str]) -> str | None:
    """The last checkpoint pass of ``points`` (None when they are the training steps alone)."""
    passes = [cp for cp in points if cp != TRAINING_STEPS]
    return passes[-1] if passes else None


def _ranking_words(ranked: OutlierScores, points: Sequence[str], last_pass: str | None) -> str:
    if ranked.by == "aum":
        return "lowest AUM (area under the margin over the training steps)"
    if ranked.by == "loss":
        return f"the loss at {last_pass!r}" if last_pass else "the loss at each sample's last training step"
    return f"TracIn self-influence summed over {', '.join(points)}"


def outlier_table(
    store: GradientStore,
    points: Sequence[str],
    k: int = 20,
    scores: Scores | None = None,
    rank_by: str = "auto",
) -> OutlierTable:
    """The ``k`` most suspicious training samples by :func:`outlier_scores`, and the table's caption.

    Each row: ``rank``, ``sample_id``, ``label``; ``pass_prediction`` and ``pass_loss`` at the last
    checkpoint pass of ``points`` (blank for a sample it does not hold); ``last_step_loss``, the loss at
    the sample's last training step; ``aum``; ``self_influence`` over ``points`` (blank for a sample
    they do not hold); ``class_zscore``, the z-score of the ranking score within the labelled class.
    A ranking that covers only some of the trained samples (by the pass loss or self-influence, where
    the passes hold a subset) says so in the caption. ``scores``: :func:`self_influence_of` over
    ``points`` when it is at hand (it reads every record of ``points``).
    """
    ranked = outlier_scores(store, points, rank_by, scores)
    last_pass = _last_pass(points)
    at_pass: dict[int, tuple[int, float]] = {}
    if last_pass is not None:
        meta = store.metadata(last_pass)
        at_pass = {int(i): (int(p), float(v)) for i, p, v in zip(meta["sample_id"], meta["prediction"], meta["loss"])}
    sources = [*points, *([TRAINING_STEPS] if ranked.trained is not None else [])]
    labels_of = {int(sid): row["label"] for sid, row in last_metadata(store, list(dict.fromkeys(sources))).items()}
    ids = ranked.ids
    labels = torch.tensor([labels_of[int(i)] if isinstance(labels_of[int(i)], int) else -1 for i in ids])
    usable = np.nan_to_num(ranked.score, nan=-np.inf)  # a sample with no score ranks last
    zscores = ops.zscore_by_class(torch.from_numpy(np.nan_to_num(ranked.score)), labels).numpy()
    order = np.argsort(-usable, kind="stable")[:k]
    rows = []
    for r, i in enumerate(order):
        sid = int(ids[i])
        prediction, loss = at_pass.get(sid, (None, None))
        rows.append(
            {
                "rank": r + 1,
                "sample_id": sid,
                "label": labels_of[sid],
                "pass_prediction": prediction,
                "pass_loss": loss,
                "last_step_loss": _number(ranked.last_step_loss[i]),
                "aum": _number(ranked.aum[i]),
                "self_influence": _number(ranked.self_influence[i]),
                "class_zscore": float(zscores[i]),
            }
        )
    return OutlierTable(rows, _caption(store, ranked, points, last_pass))


def _caption(store: GradientStore, ranked: OutlierScores, points: Sequence[str], last_pass: str | None) -> list[str]:
    trained = ranked.trained
    scored = int(np.isfinite(ranked.score).sum())
    subset = trained is not None and trained > scored
    of = f" of the {trained} trained; the other {(trained or 0) - scored} are not ranked" if subset else ""
    lines = [f"ranked by {_ranking_words(ranked, points, last_pass)}: {scored} samples{of}"]
    if last_pass is not None:
        held = len(np.unique(store.sample_ids(last_pass)))
        lines.append(f"pass_prediction, pass_loss: at {last_pass!r} ({held} samples; blank: not in it)")
    if trained is not None:
        lines.append("last_step_loss: at the sample's last training step; aum: over its training steps")
    lines.append(f"self_influence: TracIn over {', '.join(points)} (blank: not in them)")
    return lines


#: characters of a sample's text in the outlier table, whose nine other columns take most of the width
OUTLIER_TEXT_CHARS = 60


def outlier_markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str], caption: Sequence[str] = ()) -> str:
    """The outlier table in markdown, then its caption (one line each), as :func:`influence_markdown` closes its table.

    The table's header stays the first line, for whatever reads the file as a table; a ``text`` column is
    cut to :data:`OUTLIER_TEXT_CHARS` characters (the JSON file keeps it whole)."""
    shown = [
        {**row, "text": shorten(row["text"], OUTLIER_TEXT_CHARS)} if row.get("text") is not None else row
        for row in rows
    ]
    return (
        markdown_table(shown, columns)
        + ("\n" if caption else "")
        + "".join(f"{one_line(line)}  \n" for line in caption)
    )


def outlier_rows(
    store: GradientStore, points: Sequence[str], k: int = 20, scores: Scores | None = None, rank_by: str = "auto"
) -> list[dict[str, Any]]:
    """The rows of :func:`outlier_table`."""
    return outlier_table(store, points, k, scores, rank_by).rows
