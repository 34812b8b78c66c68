"""``fit_bases`` and ``eigenbasis_record`` on layers the capture tests do not reach: a dense layer whose Fisher is
kept diagonal keeps its coordinates of largest mean square; grouped weights and tied layers get no basis."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.ops import curvature as kfac
from metastore_plugins.core.ops.curvature import CurvatureSums
from metastore_plugins.core.ops.eigenbasis import (
    eigenbasis_record,
    fit_bases,
    fittable,
    subspace_cheaper,
    top_eigenpairs,
)
from metastore_plugins.testing import reference_per_sample_gradients


def _records(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list:
    with CaptureSession(model, loss_reduction="sum") as session:
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    return session.factors()


def test_a_diagonal_fisher_layer_keeps_its_largest_coordinates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kfac, "FULL_FISHER_MAX_PARAMS", 8)  # LayerNorm(6): 12 parameters, a diagonal Fisher
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    sums = CurvatureSums()
    records = _records(model, x, y)
    sums.add(fittable(records))
    k = 3  # 9 of the 12 coordinates
    basis = fit_bases(sums, k, step=7)["1"]
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="sum")  # noqa: E731
    grads = reference_per_sample_gradients(model, loss, (x, y))
    flat = torch.cat([grads["1.weight"].reshape(16, -1), grads["1.bias"].reshape(16, -1)], 1).double()  # (16, 12)
    top = flat.square().mean(0).argsort(descending=True)[: k * k]
    group = [r for r in records if r.layer == "1"]
    kept = eigenbasis_record(group, basis)
    torch.testing.assert_close(kept.tensors["projected"].double().reshape(16, -1), flat[:, top], rtol=1e-5, atol=1e-7)
    assert kept.basis == 7
    torch.testing.assert_close(float(kept.tensors["mean_eigenvalue"]), float(flat.square().mean()), rtol=1e-5, atol=0)


def test_grouped_weights_get_no_basis_and_tied_layers_are_not_fitted() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 3))
    x, y = torch.randn(6, 4, 3, 3), torch.randint(0, 3, (6,))  # one position: the conv is kept factored
    records = _records(conv, x, y)
    assert next(r for r in records if r.layer == "0").kind == "outer"
    sums = CurvatureSums()
    sums.add(fittable(records))
    assert sorted(fit_bases(sums, 2, step=1)) == ["2"]  # two weight groups: the seeded projection keeps them

    tied = _Tied()
    with CaptureSession(tied, loss_reduction="sum") as session:
        tied(torch.randint(0, 7, (3, 2))).sum().backward()
    assert [r.layer for r in session.factors()] and [r.layer for r in fittable(session.factors())] == []


class _Tied(nn.Module):
    """An embedding and an output layer sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 7), nn.Linear(7, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_subspace_iteration_finds_the_top_eigenpairs_of_a_large_covariance() -> None:
    d, k = 612, 8
    assert subspace_cheaper(d, k)
    g = torch.Generator().manual_seed(2)
    q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    spectrum = 1.0 / torch.arange(1, d + 1, dtype=torch.float64)  # a covariance's decaying eigenvalues
    matrix = (q * spectrum) @ q.T
    values, vectors = top_eigenpairs(matrix, k)
    torch.testing.assert_close(values, spectrum[:k], rtol=1e-6, atol=0)
    overlap = torch.linalg.svdvals(q[:, :k].T @ vectors)  # cosines of the principal angles
    assert float(overlap.min()) > 1 - 1e-6


def test_a_rank_bound_below_k_completes_the_top_pairs_with_an_orthonormal_null_space() -> None:
    """A full Fisher of 12 samples at ``k = 40`` of 60 parameters: 12 nonzero pairs (numpy's), then 28 null vectors."""
    g = torch.Generator().manual_seed(3)
    grads = torch.randn(12, 60, generator=g, dtype=torch.float64)  # (N, P) per-sample gradients
    fisher = grads.T @ grads / 12
    values, vectors = top_eigenpairs(fisher, 40, rank=12)
    want = np.linalg.eigvalsh(fisher.numpy())[::-1]  # descending
    np.testing.assert_allclose(values[:12].numpy(), want[:12], rtol=1e-5)
    assert values.shape == (40,) and float(values[12:].abs().max()) < 1e-12 * float(want[0])
    torch.testing.assert_close(vectors.T @ vectors, torch.eye(40, dtype=torch.float64), rtol=0, atol=1e-5)
    residual = fisher @ vectors - vectors * values  # an eigenbasis: M q = lambda q for every kept pair
    assert float(residual.abs().max()) < 1e-5 * float(want[0])
