"""``store.in_run_influence(tests, method=...)``: training steps paired with checkpoint passes, against dense inverses.

The training steps of window ``c`` (steps 2c and 2c+1, samples 0-11 then 12-23, each step its own rate)
were taken at the weights of checkpoint ``c``; test pass ``c`` at the start of the window (step 2c: taken before
the window's steps, at the weights they start from, as the callbacks' ``start`` and epoch-end passes are).
Each step goes with the pass before it and the pass after it (:data:`PAIRS`). The reference knows nothing of the
store: per-sample gradients and factors from ``torch.func`` (:mod:`kfaccases`), K-FAC / EK-FAC of each pair's
steps as explicit ``(P, P)`` matrices inverted with ``torch.linalg.solve``, the step rates applied by hand, a
sample's occurrences summed.
"""

from __future__ import annotations

import kfaccases
import numpy as np
import pytest
import torch
from kfaccases import blocks, data, paired_scores, per_sample_ce, rel_err
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


#: (test pass, the checkpoints whose steps it is paired with): pass 0 with the steps after it (0-1), pass 1 with
#: the steps after it (2-3) and with those before it since pass 0 (0-1, and 2-3: the steps after the last pass go
#: with it as both)
PAIRS = ((0, (0,)), (1, (1,)), (1, (0, 1)))


def reference(method: str | None) -> np.ndarray:
    """``(24, 8)`` ``sum_(c, t) lr_t g_i(w_t)^T P g_test(w_c)`` over :data:`PAIRS`: ``P`` the identity (``None``) or
    the damped inverse of the curvature fitted on the pair's steps."""
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    with torch.no_grad():
        train = [blocks(model, x, y) for model in checkpoints()]
        test = [blocks(model, xt, yt) for model in checkpoints()]
    rates = [torch.tensor([STEP_LRS[2 * c]] * 12 + [STEP_LRS[2 * c + 1]] * 12, dtype=torch.float64) for c in (0, 1)]
    return paired_scores(method, train, test, rates, PAIRS).numpy()


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


def test_step_windows_pair_each_step_with_the_passes_around_it(store: GradientStore) -> None:
    tests = ["epoch-0/test", "epoch-1/test"]
    assert step_windows(store, "train", tests) == [
        ("epoch-0/test", (0, 1)),  # the steps after each pass
        ("epoch-1/test", (2, 3)),
        ("epoch-1/test", (0, 3)),  # the steps before each pass since the previous, after the last pass with it
    ]
    # steps before the first pass go with the first as both, as after the last; a range cuts each window
    assert step_windows(store, "train", ["epoch-0/test"]) == [("epoch-0/test", (0, 3))] * 2
    assert step_windows(store, "train", ["epoch-1/test"]) == [("epoch-1/test", (0, 3))] * 2
    assert step_windows(store, "train", tests, (1, 2)) == [
        ("epoch-0/test", (1, 1)),
        ("epoch-1/test", (2, 2)),
        ("epoch-1/test", (1, 2)),
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
