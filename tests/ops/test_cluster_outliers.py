"""kmeans, per-class z-scores and outlier ranking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opscases import Case, flat_reference, rel_err

from metastore_plugins.core.ops import kmeans, rank_outliers, sq_norms_by_param, zscore_by_class


def _blobs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.0, 0.0, 0.0], [10.0, 0.0, 0.0], [0.0, 10.0, 5.0]])
    truth = torch.arange(60) % 3
    return centres[truth] + torch.randn(60, 3, generator=g), truth


def test_kmeans_recovers_separated_blobs() -> None:
    x, truth = _blobs()
    result = kmeans(x, 3, seed=1)
    mapping = {int(t): int(result.labels[truth == t][0]) for t in range(3)}
    assert len(set(mapping.values())) == 3
    assert torch.equal(result.labels, torch.tensor([mapping[int(t)] for t in truth]))
    centroids = torch.stack([x[truth == t].mean(0) for t in range(3)])
    for t, label in mapping.items():
        assert torch.allclose(result.centroids[label], centroids[t], atol=1e-5)
    assert result.inertia == pytest.approx(float(((x - centroids[truth]) ** 2).sum()), rel=1e-5)


def test_kmeans_is_deterministic() -> None:
    x, _ = _blobs(1)
    a, b = kmeans(x, 4, seed=5), kmeans(x, 4, seed=5)
    assert torch.equal(a.labels, b.labels)  # the same seed, the same initial centres and assignments
    # the centres are means computed twice: equal up to fp32 round-off (another seed's are O(1) apart)
    torch.testing.assert_close(a.centroids, b.centroids, rtol=1e-6, atol=1e-6)


def test_kmeans_edge_cases() -> None:
    x = torch.ones(5, 2)
    result = kmeans(x, 2, seed=0)  # identical points: no crash, zero inertia (up to round-off)
    assert result.inertia == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="between 1 and the number of points"):
        kmeans(x, 6)
    with pytest.raises(ValueError, match="2-D"):
        kmeans(torch.ones(5), 1)


def test_zscore_by_class_matches_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    values, labels = torch.rand(40, generator=g) * 5, torch.randint(0, 3, (40,), generator=g)
    labels[0] = 7  # a class of one sample
    z = zscore_by_class(values, labels)
    v, lab = values.double().numpy(), labels.numpy()
    for c in np.unique(lab):
        members = v[lab == c]
        expected = np.zeros_like(members) if members.std() == 0 else (members - members.mean()) / members.std()
        np.testing.assert_allclose(z[torch.from_numpy(lab == c)].numpy(), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="1-D of one length"):
        zscore_by_class(values, labels[:-1])


def test_rank_outliers() -> None:
    ranking = rank_outliers(torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0]), k=3)
    assert ranking.indices.tolist() == [1, 3, 4]  # ties keep their order
    assert ranking.scores.tolist() == [3.0, 3.0, 2.0]
    assert rank_outliers(torch.tensor([0.5, 3.0, -1.0]), largest=False).indices.tolist() == [2, 0, 1]


def test_gradient_norm_zscores_from_records(case: Case) -> None:
    """The mislabeled-data score: per-class z-score of per-sample gradient norms, from the factors."""
    norms = sum(v for r in case.train_records for v in sq_norms_by_param(r).values()).sqrt()
    expected_norms = flat_reference(case.train_ref, sorted(case.train_ref)).norm(dim=1)
    labels = case.train_batch["y"]
    assert rel_err(zscore_by_class(norms, labels), zscore_by_class(expected_norms, labels)) <= 1e-4
