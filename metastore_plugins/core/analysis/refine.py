"""Screen on the cheap representation, refine exactly: influence scores recomputed for the candidates that matter.

A store kept under ``policy="auto"`` answers ``influence`` with estimates (inner products of
projected gradients, error about ``1/sqrt(k)`` of ``||g_i|| ||g_j||`` per layer). The few training
samples a report shows are then recomputed exactly, at the weights of each checkpoint pass
(the weight snapshots in the store), by a ``recompute`` function the caller provides (the
callbacks have the live model and datasets; see :func:`~metastore_plugins.core.model.recompute.recompute`):

1. per test sample, the ``candidates`` largest and smallest estimated scores (``max_samples``: at most
   that many training samples in all, the shallowest ranks of every test sample first);
2. for their union ``U``, exact TracIn ``sum_c lr_c <g_i(w_c), g_j(w_c)>`` from recomputed records;
3. rows of ``U`` take their exact scores, marked in :attr:`RefinedScores.exact`; rankings
   (:meth:`RefinedScores.top`) order the candidates by them.

What is exact is exact to float rounding; a proponent outside the candidates would need an
estimate error beyond the candidates' margin (measured in docs/policies.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metastore_plugins.core import ops
from metastore_plugins.core.analysis.queries import paired_points
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import StoreReader

#: ``(split, sample ids, checkpoint name) -> exact records of those samples``, one batch, in that order,
#: at the weights the checkpoint pass ``checkpoint`` (``"epoch-1"``) saw.
RecomputeFn = Callable[[str, Sequence[int], str], Sequence[LayerRecord]]


@dataclass(frozen=True)
class RefinedScores(Scores):
    """:class:`Scores` whose rows in ``exact`` hold exact TracIn scores (recomputed), the others estimates."""

    exact: np.ndarray | None = None  # (N,) bool: rows recomputed exactly

    def top(self, k: int = 10) -> list[dict[str, Any]]:
        """Per test sample, proponents and opponents among the exactly recomputed rows, with ``"exact": True``."""
        if self.exact is None or not self.exact.any():
            return [{**row, "exact": False} for row in super().top(k)]
        rows = np.flatnonzero(self.exact)
        kept = Scores(self.scores[rows], self.row_ids[rows], self.col_ids)
        return [{**row, "exact": True} for row in kept.top(k)]


#: Rank depth per test sample and direction: the refinement looks no deeper into an estimated ranking.
CANDIDATES = 50

#: The most training samples one refinement recomputes exactly (at each checkpoint pass), when a caller caps it:
#: its cost is then ``(max_samples + M) x passes`` forward and backward passes, whatever the training set. Not
#: the default: on the digits example kept projected 4x4, a cap of 256 of the 371 candidates kept 62% of the
#: report's top-5 lists equal to exact TracIn against 84% uncapped (docs/policies.md).
REFINE_SAMPLES = 256

#: Training samples recomputed at once: the exact records held in memory at a time (MiniLM: about 2.6 MB each).
REFINE_CHUNK = 64


def candidate_rows(scores: np.ndarray, candidates: int, limit: int | None = None) -> np.ndarray:
    """Sorted rows among the ``candidates`` largest or smallest of some column of ``(N, M)`` scores.

    With ``limit``, at most that many rows, taken by depth: every column's largest and smallest
    first, then every column's second, and so on (within one depth, column by column), so that each
    column's strongest candidates are kept before any column's weaker ones.
    """
    n = scores.shape[0]
    depth = min(candidates, -(-n // 2))
    if limit is None and n <= 2 * candidates:
        return np.arange(n)
    order = np.argsort(scores, axis=0, kind="stable")  # (N, M) ascending per column
    seq = np.stack([order[::-1][:depth], order[:depth]], axis=2).reshape(-1)  # (depth * M * 2,) depth-major
    unique, first = np.unique(seq, return_index=True)
    ranked = unique[np.argsort(first, kind="stable")]  # rows in the order they are first reached
    return np.sort(ranked if limit is None else ranked[: max(0, limit)])


def refine_influence(
    store: StoreReader,
    estimate: Scores,
    train: str | Sequence[str],
    test: str | Sequence[str],
    recompute: RecomputeFn,
    *,
    candidates: int = CANDIDATES,
    max_samples: int | None = None,
    chunk: int = REFINE_CHUNK,
) -> RefinedScores:
    """Exact TracIn scores for each test sample's strongest proponents and opponents by ``estimate``.

    Args:
        estimate: ``store.influence(train, test, ...)`` (rows: train ids, columns: test ids).
        train, test: the paired checkpoint capture points the estimate summed over.
        recompute: see :data:`RecomputeFn`; called per checkpoint for the test samples once and for the
            training samples in chunks of ``chunk`` (the exact records in memory at a time).
        candidates: the depth of each test sample's ranking (both directions) that is recomputed.
        max_samples: the most training samples recomputed (:func:`candidate_rows`: the shallowest
            ranks of every test sample first, e.g. :data:`REFINE_SAMPLES`); ``None`` (default): every
            candidate, at most ``2 candidates M``.
    """
    rows = candidate_rows(estimate.scores, candidates, max_samples)
    train_ids = [int(i) for i in estimate.row_ids[rows]]
    test_ids = [int(i) for i in estimate.col_ids]
    exact = np.zeros((len(rows), len(test_ids)))
    step = max(1, chunk)
    for train_cp, test_cp in paired_points(train, test):
        checkpoint, test_split = train_cp.split("/")[0], test_cp.split("/", 1)[1]
        split, lr = train_cp.split("/", 1)[1], store.learning_rate(train_cp)
        b = list(recompute(test_split, test_ids, checkpoint))
        for lo in range(0, len(train_ids), step):
            a = list(recompute(split, train_ids[lo : lo + step], checkpoint))
            exact[lo : lo + step] += (1.0 if lr is None else lr) * ops.total_dots(a, b).double().cpu().numpy()
    scores = estimate.scores.astype(np.float64, copy=True)
    scores[rows] = exact
    mask = np.zeros(len(estimate.row_ids), dtype=bool)
    mask[rows] = True
    return RefinedScores(scores, estimate.row_ids, estimate.col_ids, mask)
