"""The small MLP of the K-FAC query tests, and its curvature built without the store's maths.

``Linear(6, 8) - Tanh - LayerNorm(8) - Linear(8, 3)`` in float64. Each Linear's inputs and the output
gradients of each sample's own loss come from ``torch.func`` (``vmap(grad(...))`` of the tail of the
network), the per-sample parameter gradients from ``reference_per_sample_gradients``; a layer's Fisher
is an explicit ``(P, P)`` matrix (:func:`fisher`): the LayerNorm's full empirical Fisher, K-FAC's a
``torch.kron`` of the two covariances, EK-FAC's that basis with the gradients' second moments.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap

from metastore_plugins.testing import reference_per_sample_gradients

#: The learning-rate weight of each of the two passes.
LRS = (0.7, 0.2)


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).double()


def data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``n`` seeded float64 inputs of the model and labels of its 3 classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def checkpoints(model_seed: int, noise_seed: int) -> list[nn.Sequential]:
    """The model at two passes: the second a seeded perturbation of the first."""
    first, second = make_model(model_seed), make_model(model_seed)
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for p in second.parameters():
            p += 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
    return [first, second]


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


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


def fisher(g: Tensor, a: Tensor | None, d: Tensor | None, method: str) -> Tensor:
    """``(P, P)`` the layer's curvature: its full empirical Fisher (no factors), else K-FAC's or EK-FAC's."""
    if a is None or d is None:
        return g.T @ g / len(g)
    c, gg = a.T @ a / len(a), d.T @ d / len(d)
    if method != "ekfac":
        return torch.kron(gg, c)
    q = torch.kron(torch.linalg.eigh(gg)[1], torch.linalg.eigh(c)[1])
    return q @ torch.diag(((g @ q) ** 2).mean(0)) @ q.T


def damped(curvature: Tensor, damping: float | None = None) -> Tensor:
    """``F + delta I``, ``delta`` 0.1 x the mean eigenvalue unless ``damping`` is given."""
    delta = 0.1 * torch.trace(curvature) / len(curvature) if damping is None else damping
    return curvature + delta * torch.eye(len(curvature), dtype=torch.float64)


#: Blocks of :func:`blocks` per checkpoint
Blocks = dict[str, tuple[Tensor, Tensor | None, Tensor | None]]


def paired_scores(
    method: str | None,
    train: list[Blocks],
    test: list[Blocks],
    rates: list[Tensor],
    pairs: tuple[tuple[int, tuple[int, ...]], ...],
) -> Tensor:
    """``(N, M)`` ``sum over pairs (c, held) of sum_{h in held} rates[h]_i g_i(w_h)^T P g_test(w_c)``: ``P`` the
    identity (``method`` None) or the damped inverse of the curvature fitted on the rows of every checkpoint in
    ``held``."""
    total = torch.zeros(len(rates[0]), len(test[0]["0"][0]), dtype=torch.float64)
    for point, held in pairs:
        for layer in train[0]:
            g, a, d = (None if part[0] is None else torch.cat(part) for part in zip(*(train[h][layer] for h in held)))
            assert g is not None
            g_test = test[point][layer][0].T  # (P, M)
            preconditioned = g_test if method is None else torch.linalg.solve(damped(fisher(g, a, d, method)), g_test)
            for h in held:
                total += rates[h][:, None] * (train[h][layer][0] @ preconditioned)  # (N, M)
    return total


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())
