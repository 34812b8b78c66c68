"""Report tables built from store queries: suspicious training samples and influence rankings.

Rows are plain dicts (JSON-ready); :mod:`~metastore_plugins.core.reports.files` writes them
as JSON, CSV and markdown.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.refine import RecomputeFn, RefinedScores, refine_influence
from metastore_plugins.core.analysis.signals import TRAINING_STEPS, training_signals


def checkpoint_points(store: GradientStore, split: str) -> list[str]:
    """Capture points ``epoch-{e}/{split}`` (or ``step-{s}/{split}``) of the checkpoint passes, in order."""

    def key(cp: str) -> tuple[int, int] | None:
        kind, _, number = cp.split("/")[0].partition("-")
        if kind not in ("epoch", "step") or not number.isdigit():
            return None
        return (0 if kind == "epoch" else 1, int(number))

    keyed = [(at, cp) for cp in store.capture_points() if cp.endswith("/" + split) and (at := key(cp)) is not None]
    return [cp for _, cp in sorted(keyed)]


def _last_metadata(store: GradientStore, points: Sequence[str]) -> dict[int, dict[str, Any]]:
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


#: where the outlier report takes self-influence from
OutlierSource = Literal["checkpoints", "training"]
OUTLIER_SOURCES: tuple[str, ...] = get_args(OutlierSource)


def check_outlier_source(outliers_from: str, training_steps: bool, owner: str) -> None:
    """Raise naming ``owner``'s setting when ``outliers_from`` is unknown or has no training steps to rank."""
    if outliers_from not in OUTLIER_SOURCES:
        raise ValueError(f"{owner}(outliers_from=...) must be one of {OUTLIER_SOURCES}, got {outliers_from!r}")
    if outliers_from == "training" and not training_steps:
        raise ValueError(
            f"{owner}(outliers_from='training') ranks the captured training steps; keep capture_train_steps=True"
        )


def outlier_points(store: GradientStore, checkpoints: Sequence[str], outliers_from: str) -> list[str]:
    """The capture points the outlier report sums self-influence over.

    ``"checkpoints"``: the training checkpoint passes (every sample at the same weights, the
    samples the passes cover). ``"training"``: the training steps (``sum_t lr_t ||g_i(w_t)||^2``
    over the steps each sample was trained in, TracIn's in-run form: every trained sample,
    no pass needed).
    """
    if outliers_from not in OUTLIER_SOURCES:
        raise ValueError(f"outliers_from must be one of {OUTLIER_SOURCES}, got {outliers_from!r}")
    if outliers_from == "checkpoints":
        return list(checkpoints)
    if TRAINING_STEPS not in store.capture_points():
        raise ValueError(
            f"outliers_from='training' needs the training steps (capture point {TRAINING_STEPS!r}), and the store "
            f"holds {store.capture_points()}; keep capture_train_steps=True or use outliers_from='checkpoints'"
        )
    return [TRAINING_STEPS]


def self_influence_of(store: GradientStore, points: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
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

    ``by``: ``"aum"`` (score ``-AUM``), ``"loss"`` or ``"self_influence"``; ``self_influence``
    and ``aum`` are NaN for samples without one (not in the passes; no margins stored).
    """

    ids: np.ndarray  # (N,) int64
    score: np.ndarray  # (N,) float64
    by: str
    self_influence: np.ndarray  # (N,)
    aum: np.ndarray  # (N,)


def _has_margins(store: GradientStore) -> bool:
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
    self_influence: tuple[np.ndarray, np.ndarray] | None = None,
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
        raise ValueError(f"rank_outliers_by must be one of {OUTLIER_RANKINGS}, got {rank_by!r}")
    margins = _has_margins(store)
    if rank_by == "aum" and not margins:
        raise ValueError(
            "rank_outliers_by='aum' needs the training steps with their margins (capture_train_steps=True and "
            "class logits); use 'self_influence' or 'auto'"
        )
    si_ids, si_values = self_influence if self_influence is not None else self_influence_of(store, points)
    signals = training_signals(store) if TRAINING_STEPS in store.capture_points() else None
    if rank_by == "loss":
        if points:
            last = store.metadata(points[-1])
            ids, score = last["sample_id"].astype(np.int64), last["loss"].astype(np.float64)
        elif signals is not None:
            ids, score = signals.sample_ids, signals.last_loss
        else:
            raise ValueError("rank_outliers_by='loss' needs checkpoint passes or training steps in the store")
    elif rank_by == "self_influence" or not margins:
        ids, score, rank_by = si_ids, si_values, "self_influence"
    else:
        assert signals is not None  # margins are read from the training steps
        ids, score, rank_by = signals.sample_ids, -signals.aum, "aum"
    aum = np.full(len(ids), np.nan) if signals is None else _aligned(ids, signals.sample_ids, signals.aum)
    return OutlierScores(ids, score, rank_by, _aligned(ids, si_ids, si_values), aum)


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def outlier_rows(
    store: GradientStore,
    points: Sequence[str],
    k: int = 20,
    scores: tuple[np.ndarray, np.ndarray] | None = None,
    rank_by: str = "auto",
) -> list[dict[str, Any]]:
    """The ``k`` most suspicious training samples by :func:`outlier_scores`.

    Each row: rank, sample_id, label, prediction, loss (at the last pass that holds the
    sample, else its last training step), aum, self_influence, and the z-score of the ranking
    score within the sample's labelled class. ``scores``: :func:`self_influence_of` over
    ``points`` when it is at hand (it reads every record of ``points``).
    """
    ranked = outlier_scores(store, points, rank_by, scores)
    steps = [TRAINING_STEPS] if TRAINING_STEPS in store.capture_points() else []
    meta = _last_metadata(store, [*steps, *points])
    ids = ranked.ids
    labels = torch.tensor([meta[int(i)]["label"] if isinstance(meta[int(i)]["label"], int) else -1 for i in ids])
    usable = np.nan_to_num(ranked.score, nan=-np.inf)  # a sample with no score ranks last
    zscores = ops.zscore_by_class(torch.from_numpy(np.nan_to_num(ranked.score)), labels).numpy()
    order = np.argsort(-usable, kind="stable")[:k]
    return [
        {
            "rank": r + 1,
            "sample_id": int(ids[i]),
            **meta[int(ids[i])],
            "aum": _number(ranked.aum[i]),
            "self_influence": _number(ranked.self_influence[i]),
            "class_zscore": float(zscores[i]),
        }
        for r, i in enumerate(order)
    ]


def influence_rows(
    store: GradientStore,
    train: Sequence[str],
    test: Sequence[str],
    k: int = 5,
    samples: int | None = None,
    recompute: RecomputeFn | None = None,
) -> list[dict[str, Any]]:
    """Per test sample: its label/prediction and the ``k`` strongest proponents and opponents.

    ``samples``: only the test samples with the ``samples`` smallest ids (all when ``None``);
    the cost grows with train x test pairs, and a report shows a handful. Each row says whether
    its scores are ``"exact"``: where the passes are kept projected, they are estimates, unless
    ``recompute`` is given: then each test sample's candidates are recomputed exactly
    (:func:`~metastore_plugins.core.analysis.refine.refine_influence`).
    """
    test_ids = None if samples is None else sorted(set(store.sample_ids(test[-1]).tolist()))[:samples]
    scores = store.influence(list(train), list(test), test_ids=test_ids)
    if not passes_exact(store):
        refined = None
        if recompute is not None:
            try:
                refined = refine_influence(store, scores, list(train), list(test), recompute)
            except Exception as exc:  # the user's model, data or a missing snapshot: keep the estimates
                warnings.warn(
                    f"influence scores stay estimates: recomputing them exactly failed ({exc!r})", stacklevel=2
                )
        scores = refined or RefinedScores(scores.scores, scores.row_ids, scores.col_ids, None)
    train_meta, test_meta = _last_metadata(store, train), _last_metadata(store, test)
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
                "exact": entry.get("exact", True),
            }
        )
    return rows


def passes_exact(store: GradientStore) -> bool:
    """Whether the store's checkpoint passes keep exact gradients (no capture plan recorded: an exact store)."""
    plan = store.config.get("capture_plan")
    return not isinstance(plan, dict) or set(plan.get("passes", {}).values()) <= {"exact"}
