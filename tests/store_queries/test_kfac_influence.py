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

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.training.passes import capture_step
from metastore_plugins.testing import reference_per_sample_gradients

LRS = (0.7, 0.2)  # per pass


def make_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).double()


def data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def checkpoints() -> list[nn.Sequential]:
    """The model at two passes: the second a seeded perturbation of the first."""
    first, second = make_model(), make_model()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in second.parameters():
            p += 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
    return [first, second]


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


def blocks(model: nn.Sequential, x: Tensor, y: Tensor) -> dict[str, tuple[Tensor, Tensor | None, Tensor | None]]:
    """Per layer ``(g (N, P), a' (N, d_in + 1), d (N, d_out))``; ``a', d`` only for the Linear layers."""
    ref = reference_per_sample_gradients(model, loss_fn, {"x": x, "y": y})
    lin0, norm, lin3 = model[0], model[2], model[3]
    z0 = lin0(x).detach()  # (N, 8)
    d0 = vmap(grad(lambda z, t: F.cross_entropy(lin3(norm(torch.tanh(z)))[None], t[None])))(z0, y)  # (N, 8)
    h = norm(torch.tanh(z0)).detach()  # (N, 8): the head's input
    d3 = vmap(grad(lambda z, t: F.cross_entropy(z[None], t[None])))(lin3(h).detach(), y)  # (N, 3)
    ones = torch.ones(len(x), 1, dtype=x.dtype)

    def linear(name: str) -> Tensor:
        return torch.cat([ref[f"{name}.weight"], ref[f"{name}.bias"][:, :, None]], 2).flatten(1)  # [W | b] row-major

    return {
        "0": (linear("0"), torch.cat([x, ones], 1), d0),
        "2": (torch.cat([ref["2.weight"], ref["2.bias"]], 1), None, None),
        "3": (linear("3"), torch.cat([h, ones], 1), d3),
    }


def reference(method: str) -> tuple[np.ndarray, float]:
    """``(24, 8)`` ``sum_c lr_c g_train^T (F_c + delta_c I)^-1 g_test``, and the largest condition number."""
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    total, kappa = torch.zeros(24, 8, dtype=torch.float64), 0.0
    for lr, model in zip(LRS, checkpoints()):
        with torch.no_grad():
            train, test = blocks(model, x, y), blocks(model, xt, yt)
        for layer, (g, a, d) in train.items():
            fisher = g.T @ g / len(g)  # a dense layer: its full empirical Fisher
            if a is not None and d is not None:
                c, gg = a.T @ a / len(a), d.T @ d / len(d)
                fisher = torch.kron(gg, c)
                if method == "ekfac":
                    q = torch.kron(torch.linalg.eigh(gg)[1], torch.linalg.eigh(c)[1])
                    fisher = q @ torch.diag(((g @ q) ** 2).mean(0)) @ q.T
            damped = fisher + 0.1 * torch.trace(fisher) / len(fisher) * torch.eye(len(fisher), dtype=torch.float64)
            total += lr * g @ torch.linalg.solve(damped, test[layer][0].T)
            kappa = max(kappa, float(torch.linalg.cond(damped)))
    return total.numpy(), kappa


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


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
