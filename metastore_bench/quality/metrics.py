"""Detection metrics: precision at k and AUROC of suspicion scores against the flipped set.

Ties are handled without an order among equal scores: precision at k counts the tied
block at the cut-off in proportion (its expectation under a random order), and AUROC uses
average ranks (Mann-Whitney U). NaN scores rank last.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata


def _clean(scores: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(scores), -np.inf, scores.astype(np.float64))


def precision_at_k(scores: np.ndarray, noisy: np.ndarray, k: int) -> float:
    """Expected share of flipped samples among the ``k`` largest ``scores`` (``noisy``: ``(N,)`` bool)."""
    if not 0 < k <= len(scores):
        raise ValueError(f"k must be in 1..{len(scores)}, got {k}")
    values = _clean(scores)
    cut = np.sort(values)[::-1][k - 1]
    above, tied = values > cut, values == cut
    take = k - int(above.sum())  # how many of the tied block the top k holds
    found = noisy[above].sum() + take * noisy[tied].mean()
    return float(found / k)


def auroc(scores: np.ndarray, noisy: np.ndarray) -> float:
    """Probability that a flipped sample scores above a clean one (ties count one half)."""
    positives, negatives = int(noisy.sum()), int((~noisy).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("AUROC needs both flipped and clean samples")
    ranks = rankdata(_clean(scores))  # (N,) average ranks, 1-based
    return float((ranks[noisy].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def flagged_scores(flagged: np.ndarray, noisy: np.ndarray) -> dict[str, float]:
    """Precision and recall of a flagged set (``(N,)`` bool), e.g. cleanlab's ``find_label_issues``."""
    hits = float((flagged & noisy).sum())
    return {
        "flagged": int(flagged.sum()),
        "precision": hits / max(1, int(flagged.sum())),
        "recall": hits / max(1, int(noisy.sum())),
    }
