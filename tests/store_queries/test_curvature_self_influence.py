"""Preconditioned and kernel self-influence against references built without the store's maths.

A store holds two checkpoint passes of 24 training samples (two batches each, the ids shuffled, each
pass with its own learning-rate weight) of a small MLP with a LayerNorm. The curvature reference
knows nothing of the factors: each Linear's inputs and output gradients of each sample's own loss come
from ``torch.func`` (``vmap(grad(...))`` of the tail of the network), the per-sample parameter gradients
from ``reference_per_sample_gradients``; each layer's Fisher is an explicit ``(P, P)`` matrix, K-FAC's a
``torch.kron`` of the two covariances, EK-FAC's that basis with the gradients' second moments, and the
self-influence ``g^T (F + delta I)^-1 g`` is a ``torch.linalg.solve``. The kernel reference is
``numpy.linalg.solve`` on the store's sketches.

Tolerance: the store keeps fp32 factors (relative rounding 6e-8); the damped inverse amplifies it by at
most its condition number (below 2,000 here, checked): ``1e-7 kappa`` relative to the largest value.
"""

from __future__ import annotations

import kfaccases
import numpy as np
import pytest
import torch
from kfaccases import LRS, blocks, damped, fisher, per_sample_ce, rel_err
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.curvature_self import kernel_self_influence, preconditioned_self_influence
from metastore_plugins.core.training.passes import capture_step

N = 24
ORDER = torch.randperm(N, generator=torch.Generator().manual_seed(4))  # the order the passes hold the samples in
PASSES = ["epoch-0/train", "epoch-1/train"]


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def checkpoints() -> list[nn.Sequential]:
    return kfaccases.checkpoints(model_seed=5, noise_seed=8)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    path = tmp_path_factory.mktemp("curvature-self-store")
    x, y = data()
    with StoreWriter(path, encoding="fp32") as writer:
        for c, model in enumerate(checkpoints()):
            for ids in ORDER.split(12):
                forward = (lambda m, rows: lambda: m(x[rows]))(model, ids)
                capture_step(
                    model, forward, y[ids], ids, per_sample_ce, writer, capture_point=PASSES[c], step=c, lr=LRS[c]
                )
            model.zero_grad()
    return open_store(path)


def reference(method: str, damping: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Per pass, ``(2, N)`` ``lr_c g_i^T (F_c + delta I)^-1 g_i`` by sample id; their sum; the largest condition."""
    x, y = data()
    per_pass, kappa = torch.zeros(2, N, dtype=torch.float64), 0.0
    for c, (lr, model) in enumerate(zip(LRS, checkpoints())):
        with torch.no_grad():
            layers = blocks(model, x, y)
        for g, a, d in layers.values():
            inverted = damped(fisher(g, a, d, method), damping)  # (P, P)
            per_pass[c] += lr * (g * torch.linalg.solve(inverted, g.T).T).sum(1)  # (N,)
            kappa = max(kappa, float(torch.linalg.cond(inverted)))
    return per_pass.numpy(), per_pass.sum(0).numpy(), kappa


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_preconditioned_self_influence_is_the_dense_inverse_summed_over_passes(
    store: GradientStore, method: str
) -> None:
    per_pass, total, kappa = reference(method)
    assert kappa < 2000
    both = preconditioned_self_influence(store, PASSES, method=method)
    assert store.self_influence_ids(PASSES).tolist() == ORDER.tolist()  # aligned per id, first-seen order
    assert rel_err(both, total[ORDER.numpy()]) <= 1e-7 * kappa
    one = preconditioned_self_influence(store, PASSES[1], method=method)  # one pass: its selection order
    assert store.sample_ids(PASSES[1]).tolist() == ORDER.tolist()
    assert rel_err(one, per_pass[1][ORDER.numpy()]) <= 1e-7 * kappa


def test_preconditioned_self_influence_takes_an_absolute_damping(store: GradientStore) -> None:
    _, total, kappa = reference("kfac", damping=0.05)
    found = preconditioned_self_influence(store, PASSES, method="kfac", damping=0.05)
    assert rel_err(found, total[ORDER.numpy()]) <= 1e-7 * max(kappa, 1.0)


def test_preconditioned_self_influence_of_some_samples_keeps_the_curvature_of_all(store: GradientStore) -> None:
    _, total, kappa = reference("ekfac")
    ids = [20, 3, 17]
    found = preconditioned_self_influence(store, PASSES, sample_ids=ids, max_bytes=2000)
    expected_ids = store.self_influence_ids(PASSES, sample_ids=ids)
    assert sorted(expected_ids.tolist()) == sorted(ids)
    assert rel_err(found, total[expected_ids]) <= 1e-7 * kappa


def kernel_reference(store: GradientStore, dim: int, regularization: float) -> np.ndarray:
    """``(N,)`` by sample id: ``sum_c lr_c s_i^T (S_c^T S_c + lambda_c I)^-1 s_i`` with numpy's solve."""
    total = np.zeros(N)
    for lr, point in zip(LRS, PASSES):
        s = store.sketches(point, dim=dim, seed=0, cache=False)  # (N, k)
        gram = s.T @ s  # (k, k)
        ridge = regularization * np.trace(gram) / len(gram)
        solved = np.linalg.solve(gram + ridge * np.eye(len(gram)), s.T)  # (k, N)
        total[store.sample_ids(point)] += lr * np.einsum("ik,ki->i", s, solved)
    return total


@pytest.mark.parametrize("regularization", [1.0, 0.3])
def test_kernel_self_influence_is_the_ridge_leverage_summed_over_passes(
    store: GradientStore, regularization: float
) -> None:
    expected = kernel_reference(store, 3, regularization)
    found = kernel_self_influence(store, PASSES, dim=3, regularization=regularization, cache=False)
    assert rel_err(found, expected[ORDER.numpy()]) <= 1e-9
    one = kernel_self_influence(store, PASSES[0], dim=3, regularization=regularization)
    s = store.sketches(PASSES[0], dim=3)  # (N, 9)
    ridge = regularization * np.trace(s.T @ s) / 9
    alone = LRS[0] * np.einsum("ik,ki->i", s, np.linalg.solve(s.T @ s + ridge * np.eye(9), s.T))
    assert rel_err(one, alone) <= 1e-9


def test_kernel_self_influence_of_some_samples_keeps_the_kernel_of_all(store: GradientStore) -> None:
    expected = kernel_reference(store, 3, 1.0)
    ids = [5, 22, 0, 13]
    found = kernel_self_influence(store, PASSES, dim=3, sample_ids=ids)
    expected_ids = store.self_influence_ids(PASSES, sample_ids=ids)
    assert sorted(expected_ids.tolist()) == sorted(ids)
    # these rows are sketched from the kept samples alone (fp32, summed in another order than the pass's):
    # 6e-8 relative, times the kernel's condition number (at most k + 1 = 10 with the ridge at the mean eigenvalue)
    assert rel_err(found, expected[expected_ids]) <= 1e-6


def test_bad_arguments_are_named(store: GradientStore) -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        preconditioned_self_influence(store, PASSES, method="tracin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="damping must be a positive number"):
        preconditioned_self_influence(store, PASSES, damping=0.0)
    with pytest.raises(ValueError, match="relative_damping must be a positive number"):
        preconditioned_self_influence(store, PASSES, relative_damping=-0.1)
    with pytest.raises(ValueError, match="regularization must be a positive number"):
        kernel_self_influence(store, PASSES, regularization=0)
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        kernel_self_influence(store, PASSES, dim=0)
    with pytest.raises(ValueError, match="capture_point must be"):
        kernel_self_influence(store, [])
