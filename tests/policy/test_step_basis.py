"""Curvature from the training steps: K-FAC sums of the steps' own factors, steps on the eigenbasis, in-run EK-FAC.

A tiny MLP is trained by hand under :class:`RunCapture` (``basis_from("steps")``, every layer projected
``k = 2``), with a checkpoint pass after 3 steps and another after 6. The references are built from
``torch.func`` per-sample gradients at each step's weights: the layer's inputs ``a_i`` (a forward by hand) and
its own-loss bias gradients ``d_i`` give ``C = mean [a, 1][a, 1]^T`` and ``G = mean d d^T``; numpy's ``eigh``
their top eigenvectors; ``Q_D^T [W_i | b_i] Q_A`` the steps' records; a dense empirical Fisher of the
flattened gradients EK-FAC's eigenvalues ``diag(Q^T F Q)`` in the block. Eigenvectors have a sign of their own
choosing, so records are compared through sign-free inner products.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset

from metastore_plugins import open_store
from metastore_plugins.core.model.pass_sources import PassSource
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.training.run import RunCapture

K, B, LR = 2, 8, 0.1
F64 = torch.float64


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 4, (n,), generator=g))


def _per_sample(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Layer ``2``'s inputs ``(N, 7)`` ``[a, 1]`` and flattened own-loss gradients ``(N, 4 * 7)`` ``[W_i | b_i]``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    inputs = torch.cat([model[1](model[0](x)).detach(), torch.ones(len(x), 1)], 1).to(F64)  # (N, 7)
    full = torch.cat([g["2.weight"], g["2.bias"][:, :, None]], 2).to(F64)  # (N, 4, 7)
    return inputs, full.reshape(len(x), -1)


def _run(path: Path) -> dict[str, Any]:
    """Train 7 steps (passes after steps 3 and 6); return what the references need, per step and pass."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train, val = _data(7 * B, 1), _data(6, 2)
    run = RunCapture(path, encoding="fp32", budget=Budget("auto", None))
    run.basis_from("steps")
    both = {"0": "projected", "2": "projected"}
    run.policy.plan = CapturePlan("auto", None, "test", "fp32", K, dict(both), dict(both), 0, 2, {})
    sources = [PassSource("val", val, list(range(6)), 3)]
    seen: dict[str, Any] = {"steps": {}, "passes": {}, "sums": None}
    try:
        for step in range(7):
            if step in (3, 6):
                if step == 3:
                    sums = run.step_sums.sums.layers["2"] if run.step_sums is not None else None
                    assert sums is not None and sums.inputs is not None and sums.outputs is not None
                    seen["sums"] = (sums.inputs[0] / sums.rows, sums.outputs[0] / sums.factored_samples)
                seen["passes"][step] = _per_sample(model, *val.tensors)
                run.checkpoint_passes(model, sources, lambda b, k: F.cross_entropy(model(b[0]), b[1]),
                                      name=f"epoch-{step // 3 - 1}", rank=0, world_size=1, to_device=lambda b: b,
                                      step=step, epoch=step // 3 - 1, lr=LR)  # fmt: skip
            x, y = train.tensors[0][step * B : (step + 1) * B], train.tensors[1][step * B : (step + 1) * B]
            seen["steps"][step] = _per_sample(model, x, y)
            run.begin_step(model)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            run.end_backward()
            run.finish_step((x, y), torch.arange(B) + step * B, step=step, lr=LR, batch_loss=loss)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        run.close()
    return seen


def _covariances(seen: dict[str, Any], steps: range) -> tuple[np.ndarray, np.ndarray]:
    """``C = mean [a, 1][a, 1]^T`` and ``G = mean d d^T`` of layer 2 over ``steps``, by hand (numpy)."""
    inputs = torch.cat([seen["steps"][s][0] for s in steps]).numpy()  # (N, 7)
    d = torch.cat([seen["steps"][s][1].reshape(-1, 4, 7)[:, :, -1] for s in steps]).numpy()  # (N, 4) bias grads
    return inputs.T @ inputs / len(inputs), d.T @ d / len(d)


def _top(matrix: np.ndarray, k: int) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix)
    return vectors[:, ::-1][:, :k]


def test_the_steps_k_fac_sums_are_the_factors_of_torch_func_gradients(tmp_path: Path) -> None:
    seen = _run(tmp_path / "store")
    c, g = _covariances(seen, range(3))
    np.testing.assert_allclose(seen["sums"][0].double().numpy(), c, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(seen["sums"][1].double().numpy(), g, rtol=1e-4, atol=1e-9)


def test_steps_after_a_pass_keep_their_gradients_on_its_eigenbasis(tmp_path: Path) -> None:
    seen = _run(tmp_path / "store")
    c, g = _covariances(seen, range(3))  # the basis of the pass at step 3: the steps before it
    q = np.kron(_top(g, K), _top(c, K))  # (28, K * K): vec(Q_D^T [W | b] Q_A) = q^T vec([W | b])
    store = open_store(tmp_path / "store")
    for steps, basis in ((range(3, 6), 3), (range(6, 7), 6)):
        if basis == 6:  # the pass at step 6: its basis from steps 3..5
            c, g = _covariances(seen, range(3, 6))
            q = np.kron(_top(g, K), _top(c, K))
        records = [
            r for b in store.select("train", steps=(steps[0], steps[-1]), layers=["2"]).batches() for r in b.records
        ]
        assert {r.basis for r in records} == {basis}
        kept = torch.cat([r.tensors["projected"] for r in records]).double().flatten(1).numpy()  # (N, K * K)
        want = torch.cat([seen["steps"][s][1] for s in steps]).numpy() @ q  # (N, K * K)
        gram = want @ want.T  # the basis is fitted in float32: entries near zero carry ~1e-7 of the largest
        np.testing.assert_allclose(kept @ kept.T, gram, rtol=1e-4, atol=1e-6 * np.abs(gram).max())
    before = [r for b in store.select("train", steps=(0, 2), layers=["2"]).batches() for r in b.records]
    assert {r.basis for r in before} == {None}  # no basis before the first pass: seeded


def test_in_run_ekfac_on_the_steps_eigenbasis_is_a_dense_inverse_in_its_block(tmp_path: Path) -> None:
    """Steps 3..5 (basis 3) against the pass at step 3, step 6 (basis 6) against the pass at step 6."""
    seen = _run(tmp_path / "store")
    want = []
    for basis, steps, fitted in ((3, range(3, 6), range(3)), (6, range(6, 7), range(3, 6))):
        c, g = _covariances(seen, fitted)
        q = np.kron(_top(g, K), _top(c, K))  # (28, K * K)
        grads = torch.cat([seen["steps"][s][1] for s in steps]).numpy()  # (N, 28)
        fisher = grads.T @ grads / len(grads)  # (28, 28) dense empirical Fisher of the window's steps
        values = np.diag(q.T @ fisher @ q)  # EK-FAC's eigenvalues in the block
        delta = 0.1 * np.trace(c) / c.shape[0] * np.trace(g) / g.shape[0]  # the whole layer's mean eigenvalue
        test = seen["passes"][basis][1].numpy()  # (6, 28) at the pass's weights
        want.append(LR * (grads @ q) @ np.diag(1 / (values + delta)) @ (test @ q).T)  # (N, 6)
    store = open_store(tmp_path / "store")
    with pytest.warns(UserWarning, match="hold different samples"):  # each window holds its own steps' samples
        scores = store.in_run_influence(["epoch-0/val", "epoch-1/val"], method="ekfac", layers=["2"])
    assert list(scores.row_ids) == list(range(3 * B, 7 * B))  # steps 0..2 are on no basis: left out
    got = scores.scores[:, np.argsort(scores.col_ids)]
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-3, atol=1e-9)
