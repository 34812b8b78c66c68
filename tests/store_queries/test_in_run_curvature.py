"""``store.in_run_influence(tests, method=...)``: training steps paired with checkpoint passes, against dense inverses.

The training steps of window ``c`` (steps 2c and 2c+1, samples 0-11 then 12-23, each step its own rate)
were taken at the weights of checkpoint ``c``; test pass ``c`` at the start of the window (step 2c: taken before
the window's steps, at the weights they start from, as the callbacks' ``start`` and epoch-end passes are).
The reference knows nothing of the store: per-sample gradients and factors from ``torch.func``
(:mod:`kfaccases`), K-FAC / EK-FAC of each window's 24 samples as explicit ``(P, P)`` matrices inverted
with ``torch.linalg.solve``, the step rates applied by hand, a sample's two occurrences summed.
"""

from __future__ import annotations

import kfaccases
import numpy as np
import pytest
import torch
from kfaccases import blocks, damped, data, fisher, per_sample_ce, rel_err
from torch import nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.in_run import step_windows
from metastore_plugins.core.training.passes import capture_step

#: the rate of each training step (two per window)
STEP_LRS = (0.7, 0.5, 0.2, 0.1)
HALVES = (torch.arange(12), torch.arange(12, 24))


def checkpoints() -> list[nn.Sequential]:
    return kfaccases.checkpoints(model_seed=5, noise_seed=11)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    path = tmp_path_factory.mktemp("in-run-store")
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    with StoreWriter(path, encoding="fp32") as writer:
        for c, model in enumerate(checkpoints()):
            for half, part in enumerate(HALVES):
                step = 2 * c + half
                forward = (lambda m, p: lambda: m(x[p]))(model, part)
                capture_step(model, forward, y[part], part, per_sample_ce, writer, capture_point="train",
                             step=step, lr=STEP_LRS[step])  # fmt: skip
            forward = (lambda m: lambda: m(xt))(model)
            ids = torch.arange(100, 108)
            capture_step(model, forward, yt, ids, per_sample_ce, writer, capture_point=f"epoch-{c}/test",
                         step=2 * c, lr=1.0)  # fmt: skip
            model.zero_grad()
    return open_store(path)


def reference(method: str | None) -> np.ndarray:
    """``(24, 8)`` ``sum_t lr_t g_i(w_c)^T P_c g_test(w_c)``: ``P_c`` the identity (``None``) or the damped inverse."""
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    total = torch.zeros(24, 8, dtype=torch.float64)
    for c, model in enumerate(checkpoints()):
        with torch.no_grad():
            train, test = blocks(model, x, y), blocks(model, xt, yt)
        rates = torch.tensor([STEP_LRS[2 * c]] * 12 + [STEP_LRS[2 * c + 1]] * 12, dtype=torch.float64)  # (24,)
        for layer, (g, a, d) in train.items():
            g_test = test[layer][0].T  # (P, 8)
            preconditioned = g_test if method is None else torch.linalg.solve(damped(fisher(g, a, d, method)), g_test)
            total += rates[:, None] * (g @ preconditioned)
    return total.numpy()


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_in_run_curvature_is_each_windows_dense_inverse(store: GradientStore, method: str) -> None:
    scores = store.in_run_influence(["epoch-0/test", "epoch-1/test"], method=method)
    assert scores.row_ids.tolist() == list(range(24)) and scores.col_ids.tolist() == list(range(100, 108))
    expected = reference(method)
    assert rel_err(scores.scores, expected) <= 1e-5
    plain = reference(None)  # the curvature changes the ranking: the test can tell them apart
    assert rel_err(scores.scores / np.abs(scores.scores).max(), plain / np.abs(plain).max()) > 0.05


def test_in_run_tracin_pairs_each_window_with_its_pass(store: GradientStore) -> None:
    scores = store.in_run_influence(["epoch-0/test", "epoch-1/test"])
    assert rel_err(scores.scores, reference(None)) <= 1e-5


def test_step_windows_pair_steps_with_the_pass_before_them(store: GradientStore) -> None:
    assert step_windows(store, "train", ["epoch-0/test", "epoch-1/test"]) == [
        ("epoch-0/test", (0, 1)),
        ("epoch-1/test", (2, 3)),
    ]
    # steps after the last pass go with it, steps before the first pass with the first; a range cuts each window
    assert step_windows(store, "train", ["epoch-0/test"]) == [("epoch-0/test", (0, 3))]
    assert step_windows(store, "train", ["epoch-1/test"]) == [("epoch-1/test", (0, 3))]
    assert step_windows(store, "train", ["epoch-0/test", "epoch-1/test"], (1, 2)) == [
        ("epoch-0/test", (1, 1)),
        ("epoch-1/test", (2, 2)),
    ]


def test_in_run_refuses_what_it_cannot_pair(store: GradientStore) -> None:
    with pytest.raises(ValueError, match="step order"):
        store.in_run_influence(["epoch-1/test", "epoch-0/test"], method="ekfac")
    with pytest.raises(ValueError, match="'train' holds gradients of 4 steps"):
        store.in_run_influence(["train"])
    with pytest.raises(ValueError, match="'tracin', 'kfac', 'ekfac'"):
        store.in_run_influence(["epoch-0/test"], method="trak")
    with pytest.raises(ValueError, match="no damping"):
        store.in_run_influence(["epoch-0/test"], damping=0.1)
