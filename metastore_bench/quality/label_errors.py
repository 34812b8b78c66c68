"""Label-error detection, measured: every detector on the same noisy labels, with its precision, AUROC and cost.

For each task, noise kind, noise rate and seed: flip the labels (:mod:`.noise`), train once
with capture and score every store detector (:mod:`.detectors`), train ``folds`` times more
for cleanlab's out-of-fold probabilities, and compare each ranking with the flipped set:
precision at k = number flipped (equal to recall at that k) and AUROC.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from metastore_plugins import open_store
from metastore_plugins.core.reports.tables import checkpoint_points, outlier_scores

from .detectors import cleanlab_scores, cross_validated_probs, store_scores
from .metrics import auroc, flagged_scores, precision_at_k
from .noise import flip_labels

#: the report's default ranking, scored like the other detectors
REPORT_DEFAULT = "report default"


class Task(Protocol):
    """What the harness needs of a task (:class:`~.digits_task.DigitsTask`, :class:`~.reviews.ReviewsTask`)."""

    labels: np.ndarray  # (N,) the clean training labels
    classes: int

    def captured_run(self, labels: np.ndarray, out: Path, seed: int) -> tuple[Path, float]: ...

    def fold_probs(
        self, labels: np.ndarray, train_rows: np.ndarray, held_rows: np.ndarray, seed: int
    ) -> np.ndarray: ...


@dataclass(frozen=True)
class Setting:
    task: str
    noise: str
    rate: float
    seed: int


def evaluate(
    task: Task, setting: Setting, *, clean_probs: np.ndarray | None, folds: int = 5, cleanlab: bool = True
) -> dict[str, Any]:
    """One setting's row: per detector ``{"precision", "auroc"}``, plus costs (trainings and seconds)."""
    noisy, flipped = flip_labels(task.labels, setting.rate, setting.noise, setting.seed, clean_probs)
    truth = np.zeros(len(noisy), dtype=bool)
    truth[flipped] = True
    k = len(flipped)
    with tempfile.TemporaryDirectory() as out:
        store_dir, train_seconds = task.captured_run(noisy, Path(out) / "run", setting.seed)
        start = time.perf_counter()
        store = open_store(store_dir)
        scores = store_scores(store, len(noisy))
        ranked = outlier_scores(store, checkpoint_points(store, "train"))  # what the outlier report ranks by
        scores[REPORT_DEFAULT] = np.full(len(noisy), np.nan)
        scores[REPORT_DEFAULT][ranked.ids] = ranked.score
        score_seconds = time.perf_counter() - start
    detectors = {
        name: {"precision": precision_at_k(values, truth, k), "auroc": auroc(values, truth)}
        for name, values in scores.items()
    }
    row: dict[str, Any] = {
        **setting.__dict__,
        "flipped": k,
        "size": len(noisy),
        "detectors": detectors,
        "store_trainings": 1,
        "store_seconds": round(train_seconds + score_seconds, 2),
    }
    if cleanlab:
        start = time.perf_counter()
        probs = cross_validated_probs(noisy, partial(task.fold_probs, noisy), folds, setting.seed)
        suspicion, flags = cleanlab_scores(noisy, probs)
        detectors[f"cleanlab label quality ({folds}-fold)"] = {
            "precision": precision_at_k(suspicion, truth, k),
            "auroc": auroc(suspicion, truth),
        }
        row["cleanlab_find_label_issues"] = flagged_scores(flags, truth)
        row["cleanlab_trainings"] = folds
        row["cleanlab_seconds"] = round(time.perf_counter() - start, 2)
    return row
