"""``store.influence(..., method=...)``, ``store.self_influence(..., method=...)`` and ``store.similar``'s refusal.

Each method is checked two ways: the dispatch gives the matrix of the function it names
(``kfac_influence``, ``kernel_influence``), and, independently, TracIn and K-FAC against explicit
references built from ``torch.func`` per-sample gradients (a dense ``(G ⊗ C + delta I)^-1`` for
K-FAC), knowing nothing of the store. A second store whose records are projected (made with
``represent`` and ``StoreWriter``) is what ``"auto"`` must refuse to precondition.

Tolerance: fp32 factors in the store (relative rounding 6e-8) amplified by the damped inverse's
condition number (checked below 2,000): ``1e-7 kappa`` relative to the largest score.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pairedcases import LRS, N_TEST, N_TRAIN, TEST, TRAIN, checkpoints, data, write_paired
from torch import Tensor, nn
from torch.func import grad, vmap

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore, curvature_self
from metastore_plugins.core.analysis.curvature import curvature_refusal, preconditionable
from metastore_plugins.core.analysis.methods import INFLUENCE_METHODS, METHOD_CHOICES, resolve_method
from metastore_plugins.core.ops.curvature import CURVATURE_METHODS
from metastore_plugins.core.ops.represent import represent
from metastore_plugins.testing import reference_per_sample_gradients


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    """Two paired passes (train in two batches, val in one) at two weights, exact fp32 factors."""
    return open_store(write_paired(tmp_path_factory.mktemp("methods-store")))


def layer_blocks(model: nn.Sequential, x: Tensor, y: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per Linear: ``(g (N, P) as [W | b] row-major, a' (N, d_in + 1), d (N, d_out))``, all from torch.func."""

    def loss_fn(m: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(m(batch["x"]), batch["y"])

    ref = reference_per_sample_gradients(model, loss_fn, {"x": x, "y": y})
    first, last = model[0], model[2]
    z = first(x).detach()  # (N, 6)
    d0 = vmap(grad(lambda z_, t: F.cross_entropy(last(torch.tanh(z_))[None], t[None])))(z, y)  # (N, 6)
    h = torch.tanh(z)  # (N, 6)
    d2 = vmap(grad(lambda o, t: F.cross_entropy(o[None], t[None])))(last(h).detach(), y)  # (N, 3)
    ones = torch.ones(len(x), 1, dtype=x.dtype)
    out = []
    for name, a, d in (("0", x, d0), ("2", h, d2)):
        g = torch.cat([ref[f"{name}.weight"], ref[f"{name}.bias"][:, :, None]], 2).flatten(1)  # (N, P)
        out.append((g, torch.cat([a, ones], 1), d))
    return out


def reference(method: str, damping: float | None = None) -> tuple[np.ndarray, float]:
    """``(N_TRAIN, N_TEST)`` ``sum_c lr_c g_i^T M_c g_j`` (``M``: identity, or the damped K-FAC inverse), and kappa."""
    (x, y), (xt, yt) = data(N_TRAIN, 1), data(N_TEST, 2)
    total, kappa = torch.zeros(N_TRAIN, N_TEST, dtype=torch.float64), 1.0
    for lr, model in zip(LRS, checkpoints()):
        with torch.no_grad():
            train, test = layer_blocks(model, x, y), layer_blocks(model, xt, yt)
        for (g, a, d), (gt, _, _) in zip(train, test):
            if method == "tracin":
                total += lr * g @ gt.T
                continue
            fisher = torch.kron(d.T @ d / len(d), a.T @ a / len(a))  # (P, P): G ⊗ C
            delta = damping if damping is not None else 0.1 * float(torch.trace(fisher)) / len(fisher)
            damped = fisher + delta * torch.eye(len(fisher), dtype=torch.float64)
            total += lr * g @ torch.linalg.solve(damped, gt.T)
            kappa = max(kappa, float(torch.linalg.cond(damped)))
    return total.numpy(), kappa


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def test_the_method_names_are_one_tuple() -> None:
    assert INFLUENCE_METHODS == ("tracin", *CURVATURE_METHODS, "trak")
    assert METHOD_CHOICES == ("auto", *INFLUENCE_METHODS)


def test_tracin_is_the_default_and_the_plain_dot_products(store: GradientStore) -> None:
    scores = store.influence(TRAIN, TEST)
    expected, _ = reference("tracin")
    assert scores.row_ids.tolist() == list(range(N_TRAIN)) and scores.col_ids.tolist() == list(range(100, 106))
    assert rel_err(scores.scores, expected) <= 1e-6
    assert np.array_equal(store.influence(TRAIN, TEST, method="tracin").scores, scores.scores)


@pytest.mark.parametrize("damping", [None, 0.05])
def test_kfac_is_the_dense_kronecker_inverse(store: GradientStore, damping: float | None) -> None:
    scores = store.influence(TRAIN, TEST, method="kfac", damping=damping)
    expected, kappa = reference("kfac", damping)
    assert kappa < 2000
    assert rel_err(scores.scores, expected) <= 1e-7 * kappa
    assert rel_err(scores.scores, reference("tracin")[0]) > 1e-2  # the preconditioning changed the scores


@pytest.mark.parametrize("method", CURVATURE_METHODS)
def test_curvature_methods_dispatch_to_kfac_influence(store: GradientStore, method: str) -> None:
    for relative in (None, 0.3):
        given = store.influence(TRAIN, TEST, method=method, relative_damping=relative, test_ids=[101, 104])
        direct = store.kfac_influence(
            TRAIN,
            TEST,
            method=method,
            relative_damping=relative or 0.1,
            test_ids=[101, 104],
        )
        assert given.col_ids.tolist() == [101, 104]
        assert np.allclose(given.scores, direct.scores, rtol=1e-12, atol=0)


def test_trak_dispatches_to_kernel_influence_with_its_regularization(store: GradientStore) -> None:
    default = store.influence(TRAIN, TEST, method="trak")
    assert np.allclose(default.scores, store.kernel_influence(TRAIN, TEST).scores, rtol=1e-12, atol=0)
    ridge = store.influence(TRAIN, TEST, method="trak", relative_damping=0.25)
    assert np.allclose(ridge.scores, store.kernel_influence(TRAIN, TEST, regularization=0.25).scores, rtol=1e-12)
    assert rel_err(ridge.scores, default.scores) > 1e-3
    part = store.influence(TRAIN, TEST, method="trak", train_ids=[2, 15, 7], test_ids=[105, 100])
    assert part.row_ids.tolist() == [2, 7, 15] and part.col_ids.tolist() == [100, 105]  # the store's order
    assert np.allclose(part.scores, default.scores[np.ix_([2, 7, 15], [0, 5])], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "kfac-ish"}, "method must be one of 'auto', 'tracin', 'kfac', 'ekfac', 'trak'"),
        ({"damping": 0.1}, "method 'tracin' has no damping"),
        ({"relative_damping": 0.1}, "method 'tracin' has no damping"),
        ({"method": "trak", "damping": 0.1}, "method 'trak' takes relative_damping"),
        ({"method": "ekfac", "damping": -1.0}, "damping must be a positive number"),
        ({"method": "ekfac", "relative_damping": 0}, "relative_damping must be a positive number"),
        ({"method": "trak", "relative_damping": True}, "relative_damping must be a positive number"),
        ({"method": "ekfac", "k": 3, "recompute": print}, "recompute= belongs to method='tracin'"),
    ],
)
def test_bad_arguments_are_named(store: GradientStore, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        store.influence(TRAIN, TEST, **options)


def test_similar_refuses_other_methods(store: GradientStore) -> None:
    with pytest.raises(ValueError, match="similar\\(\\) compares plain gradients"):
        store.similar(TEST[0], TRAIN[0], method="ekfac")
    with pytest.raises(ValueError, match="method must be one of"):
        store.similar(TEST[0], TRAIN[0], method="nope")
    plain = store.similar(TEST[0], TRAIN[0], method="tracin")
    assert np.array_equal(plain.scores, store.similar(TEST[0], TRAIN[0]).scores)


def test_self_influence_tracin_is_the_lr_weighted_squared_norms(store: GradientStore) -> None:
    (x, y) = data(N_TRAIN, 1)
    expected = np.zeros(N_TRAIN)
    for lr, model in zip(LRS, checkpoints()):
        with torch.no_grad():
            expected += lr * sum(float(0) + (g**2).sum(1).numpy() for g, _, _ in layer_blocks(model, x, y))
    found = store.self_influence(TRAIN)
    assert rel_err(found, expected) <= 1e-6
    assert np.array_equal(store.self_influence(TRAIN, method="tracin"), found)
    with pytest.raises(ValueError, match="method 'tracin' has no damping"):
        store.self_influence(TRAIN, damping=0.1)
    with pytest.raises(ValueError, match="method must be one of"):
        store.self_influence(TRAIN, method="influence")


def write_projected(path: Path) -> None:
    """Two paired passes whose records are seeded random projections (``represent``), written directly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    with StoreWriter(path) as writer:
        for epoch in range(2):
            for split, rows in (("train", slice(0, 8)), ("val", slice(8, 12))):
                with CaptureSession(model, loss_reduction="sum") as session:
                    F.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
                records = represent(session.factors(), {"0": "projected", "2": "projected"}, 2, 2)
                ids = torch.arange(12)[rows]
                writer.write(
                    records, sample_ids=ids, step=epoch, capture_point=f"epoch-{epoch}/{split}", labels=y[rows]
                )
                model.zero_grad()


def test_auto_is_ekfac_on_exact_factors_and_tracin_on_projected_records(store: GradientStore, tmp_path: Path) -> None:
    assert preconditionable(store, TRAIN + TEST) and curvature_refusal(store, TRAIN + TEST) is None
    assert resolve_method(store, "auto", TRAIN + TEST).method == "ekfac"
    assert resolve_method(store, "kfac", TRAIN + TEST).method == "kfac"
    write_projected(tmp_path / "projected")
    projected = open_store(tmp_path / "projected")
    assert not preconditionable(projected, TRAIN + TEST)
    resolved = resolve_method(projected, "auto", TRAIN + TEST)
    assert resolved.method == "tracin" and resolved.fallback is not None and "projected" in resolved.fallback
    assert "epoch-0/train" in resolved.fallback  # the capture point K-FAC refused
    with pytest.raises(ValueError, match="projected"):
        projected.influence(TRAIN, TEST, method="ekfac")  # asked for by name: kfac_influence's own refusal
    with pytest.raises(ValueError, match="must be one of 'auto', 'tracin'"):
        resolve_method(projected, "best", TRAIN)


def test_preconditioned_self_influence_dispatch(store: GradientStore) -> None:
    for method in CURVATURE_METHODS:
        given = store.self_influence(TRAIN, method=method)
        direct = curvature_self.preconditioned_self_influence(store, TRAIN, method=method, relative_damping=0.1)
        assert np.allclose(given, direct, rtol=1e-12, atol=0)
    expected, kappa = reference_self("kfac")
    assert rel_err(store.self_influence(TRAIN, method="kfac"), expected) <= 1e-7 * kappa
    given = store.self_influence(TRAIN, method="trak", relative_damping=0.5)
    assert np.allclose(given, curvature_self.kernel_self_influence(store, TRAIN, regularization=0.5), rtol=1e-12)
    with pytest.raises(ValueError, match="method 'trak' takes relative_damping"):
        store.self_influence(TRAIN, method="trak", damping=0.2)


def reference_self(method: str) -> tuple[np.ndarray, float]:
    """``(N_TRAIN,)`` ``sum_c lr_c g_i^T (G ⊗ C + delta I)^-1 g_i`` from torch.func, and kappa."""
    x, y = data(N_TRAIN, 1)
    total, kappa = torch.zeros(N_TRAIN, dtype=torch.float64), 1.0
    for lr, model in zip(LRS, checkpoints()):
        with torch.no_grad():
            blocks = layer_blocks(model, x, y)
        for g, a, d in blocks:
            fisher = torch.kron(d.T @ d / len(d), a.T @ a / len(a))  # (P, P)
            damped = fisher + 0.1 * float(torch.trace(fisher)) / len(fisher) * torch.eye(len(fisher), dtype=g.dtype)
            total += lr * (g * torch.linalg.solve(damped, g.T).T).sum(1)
            kappa = max(kappa, float(torch.linalg.cond(damped)))
    return total.numpy(), kappa
