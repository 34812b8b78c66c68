"""The exact refinement of influence estimates is bounded: at most ``max_samples`` training samples are
recomputed (the shallowest ranks of every test sample first), in chunks of at most ``chunk``, and the
rows it marks exact hold exact TracIn scores.

References written here: per-sample gradients from ``torch.func`` (``reference_per_sample_gradients``)
at each checkpoint's weights, and the candidate order by a plain loop over depths and columns. fp64 model,
records captured in fp32: relative error ``1e-5`` (tests/README.md: fp32 capture against the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.analysis.refine import candidate_rows, refine_influence
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.model.recompute import recompute_batches
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.testing import reference_per_sample_gradients

TOL = 1e-5
N_TRAIN, N_TEST, LRS = 40, 6, {"epoch-0": 0.5, "epoch-1": 0.25}


class Store:
    """What refine_influence reads of a store: the learning rate of each training pass."""

    def learning_rate(self, capture_point: str) -> float:
        return LRS[capture_point.split("/")[0]]


def _data() -> dict[str, tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    make = lambda n: (torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))  # noqa: E731
    return {"train": make(N_TRAIN), "val": make(N_TEST)}


def _models() -> dict[str, nn.Module]:
    models = {}
    for k, name in enumerate(LRS):
        torch.manual_seed(k)
        models[name] = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    return models


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _exact(data: dict[str, tuple[Tensor, Tensor]], models: dict[str, nn.Module]) -> np.ndarray:
    """``sum_c lr_c <g_i(w_c), g_j(w_c)>`` (N_TRAIN, N_TEST) from torch.func per-sample gradients."""
    total = np.zeros((N_TRAIN, N_TEST))
    for name, model in models.items():
        flat = {}
        for split, batch in data.items():
            grads = reference_per_sample_gradients(model, _loss, batch)
            flat[split] = torch.cat([g.reshape(len(batch[0]), -1) for g in grads.values()], 1)  # (n, P)
        total += LRS[name] * (flat["train"] @ flat["val"].T).numpy()
    return total


def _depth_first(scores: np.ndarray, depth: int, limit: int) -> list[int]:
    """Rows by depth: at depth d, each column's d-th largest then d-th smallest, columns in order."""
    chosen: list[int] = []
    for d in range(min(depth, scores.shape[0])):
        for j in range(scores.shape[1]):
            column = np.argsort(scores[:, j], kind="stable")
            for row in (int(column[-1 - d]), int(column[d])):
                if row not in chosen and len(chosen) < limit:
                    chosen.append(row)
    return sorted(chosen)


@pytest.mark.parametrize(("depth", "limit"), [(3, 10), (8, 17), (50, 1000), (2, 1)])
def test_candidate_rows_by_depth(depth: int, limit: int) -> None:
    scores = np.random.default_rng(0).normal(size=(N_TRAIN, N_TEST))
    rows = candidate_rows(scores, depth, limit)
    assert rows.tolist() == _depth_first(scores, depth, limit)
    assert len(rows) <= limit


def test_refinement_recomputes_at_most_the_cap_in_chunks() -> None:
    data, models = _data(), _models()
    exact = _exact(data, models)
    noisy = exact + np.random.default_rng(1).normal(scale=0.3 * np.abs(exact).mean(), size=exact.shape)
    estimate = Scores(noisy, np.arange(100, 100 + N_TRAIN), np.arange(N_TEST))  # ids are not positions
    calls: list[tuple[str, list[int], str]] = []

    def recompute(split: str, ids: Sequence[int], checkpoint: str) -> list[LayerRecord]:
        calls.append((split, list(ids), checkpoint))
        rows = [i - 100 for i in ids] if split == "train" else list(ids)
        x, y = data[split]
        return recompute_batches(models[checkpoint], [(x[rows], y[rows])], weights=None, loss_fn=_loss)

    cap, chunk = 15, 4
    points = (["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"])
    refined = refine_influence(Store(), estimate, *points, recompute, candidates=10, max_samples=cap, chunk=chunk)

    train_calls = [c for c in calls if c[0] == "train"]
    recomputed = {i for c in train_calls for i in c[1]}
    assert len(recomputed) == cap and all(len(c[1]) <= chunk for c in train_calls)
    for checkpoint in LRS:  # each training sample once per checkpoint; the test samples once per checkpoint
        assert sorted(i for c in train_calls if c[2] == checkpoint for i in c[1]) == sorted(recomputed)
        assert [c[1] for c in calls if c[0] == "val" and c[2] == checkpoint] == [list(range(N_TEST))]
    assert refined.exact is not None
    assert sorted(int(i) for i in estimate.row_ids[refined.exact]) == sorted(recomputed)
    assert sorted(i - 100 for i in recomputed) == _depth_first(noisy, 10, cap)
    marked = refined.exact
    assert np.abs(refined.scores[marked] - exact[marked]).max() <= TOL * np.abs(exact).max()
    assert np.array_equal(refined.scores[~marked], noisy[~marked])  # the others stay estimates


def test_no_cap_recomputes_every_candidate() -> None:
    scores = np.random.default_rng(2).normal(size=(N_TRAIN, N_TEST))
    assert candidate_rows(scores, N_TRAIN, None).tolist() == list(range(N_TRAIN))
    assert candidate_rows(scores, 2, None).tolist() == _depth_first(scores, 2, N_TRAIN)
