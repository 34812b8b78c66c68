"""Label-error detectors: scores from one captured run's store, and cleanlab's from K-fold predictions.

Every detector returns ``(N,)`` suspicion scores over the training rows ``0..N-1`` (larger:
more likely mislabelled; NaN where a detector has nothing for a row).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.curvature_self import kernel_self_influence, preconditioned_self_influence
from metastore_plugins.core.analysis.signals import suspicion, training_signals
from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.ops.curvature import CurvatureMethod
from metastore_plugins.core.reports.tables import TRAINING_STEPS, checkpoint_points, self_influence_of

#: detectors read from the store, in table order; ``"checkpoint"`` ones need passes, the others training steps
STORE_DETECTORS = (
    "final loss",
    "self-influence (checkpoints)",
    "self-influence (checkpoints, projected 8x8)",
    "self-influence EK-FAC (checkpoints)",
    "self-influence K-FAC (checkpoints)",
    "self-influence TRAK kernel (checkpoints)",
    "self-influence (training steps)",
    "mean training loss",
    "AUM",
    "forgetting events",
    "data-map confidence",
    "AUM + self-influence (rank mean)",
)


#: the preconditioned self-influence detectors: ``self-influence {label} (checkpoints)`` and the method they fit
CURVATURE_DETECTORS: tuple[tuple[str, CurvatureMethod], ...] = (("EK-FAC", "ekfac"), ("K-FAC", "kfac"))


def _aligned(ids: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.nan)
    out[ids.astype(np.int64)] = values
    return out


def _projected_self_influence(store: GradientStore, points: list[str], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``sum_c lr_c ||S_c g_i||^2`` with per-layer ``dim x dim`` Kronecker sketches (what a projected pass keeps)."""
    ids = np.concatenate([store.sample_ids(p) for p in points])  # (occurrences,)
    values = np.concatenate(
        [(store.learning_rate(p) or 1.0) * (store.sketches(p, dim=dim, combine="concat") ** 2).sum(1) for p in points]
    )
    unique, inverse = np.unique(ids, return_inverse=True)
    total = np.zeros(len(unique))
    np.add.at(total, inverse, values)
    return unique, total


def _exact_layers(store: GradientStore, point: str) -> list[str]:
    """The layers a pass keeps as exact factors or dense gradients (what K-FAC fits; embeddings left out)."""
    batch = next(store.select(point).batches(), None)
    return sorted({r.layer for r in batch.records if r.kind in ("outer", "dense")}) if batch is not None else []


def _curvature_self_influence(store: GradientStore, passes: list[str], n: int) -> dict[str, np.ndarray]:
    """Self-influence through the curvature of each pass (``sum_c lr_c g_i^T (F_c + delta I)^-1 g_i``, EK-FAC and
    K-FAC, Kronfluence's damping) and through TRAK's kernel on 32x32 sketches, over the passes' exact layers."""
    layers = _exact_layers(store, passes[0])
    if not layers:
        return {}
    ids, out = store.self_influence_ids(passes), {}
    for label, method in CURVATURE_DETECTORS:
        try:
            found = preconditioned_self_influence(store, passes, method=method, layers=layers)
        except RepresentationError:  # a layer kept exact in the first batch and projected in a later one
            return {}
        out[f"self-influence {label} (checkpoints)"] = _aligned(ids, found, n)
    out["self-influence TRAK kernel (checkpoints)"] = _aligned(
        ids, kernel_self_influence(store, passes, layers=layers), n
    )
    return out


def store_scores(store: GradientStore, n: int, split: str = "train") -> dict[str, np.ndarray]:
    """Every store detector's ``(n,)`` suspicion scores (those whose capture points the store lacks are left out)."""
    out: dict[str, np.ndarray] = {}
    passes = checkpoint_points(store, split)
    if passes:
        last = store.metadata(passes[-1])
        out["final loss"] = _aligned(last["sample_id"], last["loss"], n)
        out["self-influence (checkpoints)"] = _aligned(*self_influence_of(store, passes), n)
        out["self-influence (checkpoints, projected 8x8)"] = _aligned(*_projected_self_influence(store, passes, 8), n)
        out.update(_curvature_self_influence(store, passes, n))
    if TRAINING_STEPS in store.capture_points():
        out["self-influence (training steps)"] = _aligned(*self_influence_of(store, [TRAINING_STEPS]), n)
        signals = training_signals(store)
        for name, signal in (
            ("mean training loss", "mean_loss"),
            ("AUM", "aum"),
            ("forgetting events", "forgetting"),
            ("data-map confidence", "confidence"),
        ):
            out[name] = _aligned(signals.sample_ids, suspicion(signals, signal), n)
    if "AUM" in out and "self-influence (checkpoints)" in out:  # the logits' view and the gradients' view
        out["AUM + self-influence (rank mean)"] = _rank(out["AUM"]) + _rank(out["self-influence (checkpoints)"])
    return out


def _rank(scores: np.ndarray) -> np.ndarray:
    """``(N,)`` average ranks in [0, 1] (NaN lowest), so that two scales can be averaged."""
    from scipy.stats import rankdata

    return rankdata(np.nan_to_num(scores, nan=-np.inf)) / len(scores)


#: ``(train rows, held-out rows, seed) -> (len(held-out), C)`` class probabilities of a model trained on the first
FoldFit = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def cross_validated_probs(labels: np.ndarray, fit_predict: FoldFit, folds: int = 5, seed: int = 0) -> np.ndarray:
    """``(N, C)`` out-of-fold probabilities from ``folds`` trainings (stratified, seeded), as cleanlab expects."""
    from sklearn.model_selection import StratifiedKFold

    probs: np.ndarray | None = None
    split = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    for fold, (train_rows, held_rows) in enumerate(split.split(np.zeros(len(labels)), labels)):
        part = fit_predict(train_rows, held_rows, seed + fold)  # (len(held_rows), C)
        if probs is None:
            probs = np.zeros((len(labels), part.shape[1]))
        probs[held_rows] = part
    assert probs is not None
    return probs


def cleanlab_scores(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cleanlab's ``(N,)`` suspicion (1 - label quality, self-confidence) and ``find_label_issues``' ``(N,)`` flags."""
    from cleanlab.filter import find_label_issues
    from cleanlab.rank import get_label_quality_scores

    quality = get_label_quality_scores(labels, probs)  # (N,) in [0, 1], low: likely an issue
    return 1.0 - quality, find_label_issues(labels, probs)
