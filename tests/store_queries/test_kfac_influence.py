"""``store.kfac_influence`` against explicit dense K-FAC / EK-FAC inverses built from torch.func quantities.

A store holds two checkpoint passes (train and test samples at the same weights, two train batches
per pass, each pass with its own learning-rate weight). The reference knows nothing of the store or
the factors: each Linear's inputs and the per-sample gradients of each sample's own loss with respect
to its output come from ``torch.func`` (``vmap(grad(...))`` of the tail of the network), the
per-sample parameter gradients from ``reference_per_sample_gradients``; the Fisher blocks are explicit
``(P, P)`` matrices, inverted with ``torch.linalg.solve``.

Tolerance: the store keeps fp32 factors (relative rounding 6e-8) and fp32 scores; the damped inverse
amplifies that by at most its condition number (below 2,000 here, checked): ``1e-7 kappa`` relative
to the largest score.
"""

from __future__ import annotations

import kfaccases
import numpy as np
import pytest
import torch
from kfaccases import LRS, blocks, damped, data, fisher, per_sample_ce, rel_err
from torch import nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.training.passes import capture_step


def checkpoints() -> list[nn.Sequential]:
    return kfaccases.checkpoints(model_seed=3, noise_seed=9)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    path = tmp_path_factory.mktemp("kfac-store")
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    with StoreWriter(path, encoding="fp32") as writer:
        for c, model in enumerate(checkpoints()):
            options = {"step": c, "lr": LRS[c]}
            for part in torch.arange(24).split(12):
                forward = (lambda m, p: lambda: m(x[p]))(model, part)
                capture_step(
                    model, forward, y[part], part, per_sample_ce, writer, capture_point=f"epoch-{c}/train", **options
                )
            forward = (lambda m: lambda: m(xt))(model)
            ids = torch.arange(100, 108)
            capture_step(model, forward, yt, ids, per_sample_ce, writer, capture_point=f"epoch-{c}/test", **options)
            model.zero_grad()
    return open_store(path)


def reference(method: str) -> tuple[np.ndarray, float]:
    """``(24, 8)`` ``sum_c lr_c g_train^T (F_c + delta_c I)^-1 g_test``, and the largest condition number."""
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    total, kappa = torch.zeros(24, 8, dtype=torch.float64), 0.0
    for lr, model in zip(LRS, checkpoints()):
        with torch.no_grad():
            train, test = blocks(model, x, y), blocks(model, xt, yt)
        for layer, (g, a, d) in train.items():
            inverted = damped(fisher(g, a, d, method))  # (P, P)
            total += lr * g @ torch.linalg.solve(inverted, test[layer][0].T)
            kappa = max(kappa, float(torch.linalg.cond(inverted)))
    return total.numpy(), kappa


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_influence_is_the_dense_inverse_summed_over_passes(store: GradientStore, method: str) -> None:
    trains, tests = ["epoch-0/train", "epoch-1/train"], ["epoch-0/test", "epoch-1/test"]
    scores = store.kfac_influence(trains, tests, method=method)
    expected, kappa = reference(method)
    assert scores.row_ids.tolist() == list(range(24)) and scores.col_ids.tolist() == list(range(100, 108))
    assert kappa < 2000
    assert rel_err(scores.scores, expected) <= 1e-7 * kappa


def test_kfac_influence_of_some_samples_keeps_the_curvature_of_all(store: GradientStore) -> None:
    trains, tests = ["epoch-0/train", "epoch-1/train"], ["epoch-0/test", "epoch-1/test"]
    part = store.kfac_influence(trains, tests, train_ids=[3, 17, 20], test_ids=[101, 106], max_bytes=2000)
    expected, kappa = reference("ekfac")
    assert part.row_ids.tolist() == [3, 17, 20] and part.col_ids.tolist() == [101, 106]
    assert rel_err(part.scores, expected[np.ix_([3, 17, 20], [1, 6])]) <= 1e-7 * kappa


def test_kfac_influence_rejects_bad_arguments(store: GradientStore) -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        store.kfac_influence("epoch-0/train", "epoch-0/test", method="tracin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="damping must be a positive number"):
        store.kfac_influence("epoch-0/train", "epoch-0/test", damping=0.0)
    with pytest.raises(ValueError, match="pair train and test"):
        store.kfac_influence(["epoch-0/train", "epoch-1/train"], "epoch-0/test")
