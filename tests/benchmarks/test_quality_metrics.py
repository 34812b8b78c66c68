"""The quality harness's metrics and label noise, against sklearn and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from metastore_bench.quality.metrics import auroc, flagged_scores, precision_at_k
from metastore_bench.quality.noise import confusion_map, flip_labels


def test_auroc_matches_sklearn_with_ties_and_nan() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 40).astype(float)  # many ties
    noisy = rng.random(40) < 0.3
    assert auroc(scores, noisy) == pytest.approx(roc_auc_score(noisy, scores), rel=1e-12)
    scores[:3] = np.nan  # NaN ranks below every number
    assert auroc(scores, noisy) == pytest.approx(roc_auc_score(noisy, np.nan_to_num(scores, nan=-1.0)), rel=1e-12)


def test_precision_at_k_is_the_expectation_over_tie_orders() -> None:
    scores = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.5])
    noisy = np.array([False, True, False, True, True, False])
    for k in range(1, 7):
        orders = [p for p in itertools.permutations(range(6)) if all(scores[a] >= scores[b] for a, b in zip(p, p[1:]))]
        want = np.mean([noisy[list(p[:k])].mean() for p in orders])
        assert precision_at_k(scores, noisy, k) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="k must be"):
        precision_at_k(scores, noisy, 0)


def test_flagged_scores() -> None:
    got = flagged_scores(np.array([True, True, False, False]), np.array([True, False, True, False]))
    assert got == {"flagged": 2, "precision": 0.5, "recall": 0.5}


def test_flips() -> None:
    labels = np.repeat(np.arange(4), 25)  # (100,)
    noisy, flipped = flip_labels(labels, 0.2, "uniform", seed=1)
    assert len(flipped) == 20 and (noisy[flipped] != labels[flipped]).all()
    assert (np.delete(noisy, flipped) == np.delete(labels, flipped)).all()
    probs = np.full((100, 4), 0.05)
    probs[np.arange(100), labels] = 0.8
    probs[np.arange(100), (labels + 2) % 4] = 0.1  # the clean model confuses c with c + 2
    probs[:5, (labels[:5] + 1) % 4] = 0.12  # and these five samples with c + 1 instead
    np.testing.assert_array_equal(confusion_map(labels, probs), [2, 3, 0, 1])
    noisy, flipped = flip_labels(labels, 0.3, "class_conditional", seed=2, clean_probs=probs)
    np.testing.assert_array_equal(noisy[flipped], (labels[flipped] + 2) % 4)
    noisy, flipped = flip_labels(labels, 0.99, "hard", seed=3, clean_probs=probs)
    second = np.where(np.arange(100) < 5, (labels + 1) % 4, (labels + 2) % 4)
    np.testing.assert_array_equal(noisy[flipped], second[flipped])
    with pytest.raises(ValueError, match="needs the clean model"):
        flip_labels(labels, 0.1, "hard", seed=0)
    with pytest.raises(ValueError, match="noise must be one of"):
        flip_labels(labels, 0.1, "pairwise", seed=0)
