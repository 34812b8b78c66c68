"""The store's curvature rows when its checkpoint passes are projected, as a budgeted capture policy keeps them.

:mod:`.lds` measures influence from an exact store (every layer's factors). A run under the default
policy with a byte budget keeps its checkpoint passes *projected* ``k x k`` per layer instead, and
``RunCapture`` then projects them onto the top of each layer's K-FAC eigenbasis, fitted at each
checkpoint on the first training samples of the pass
(:mod:`metastore_plugins.core.training.basis_fit`), so that K-FAC / EK-FAC still apply to what is kept.
This module trains the task once more (same seed, same data order: the same run) with ``RunCapture``
writing the epoch-end passes under a plan that projects every layer with more than ``k^2`` parameters
(the embedding included), and scores ``kfac_influence`` and ``influence`` on that store.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from metastore_plugins import open_store
from metastore_plugins.core.model.pass_sources import PassSource
from metastore_plugins.core.ops.curvature import CurvatureMethod
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.training.run import RunCapture

from .digits import train_model
from .lds_setup import Setup, ordered
from .lds_tasks import build_model


def capture_projected(
    setup: Setup, data: tuple[Tensor, Tensor, Tensor, Tensor], layers: list[str], k: int, path: Path
) -> None:
    """Train as :func:`.lds.run` does and write the epoch-end passes ``epoch-e/train``, ``epoch-e/test``
    projected ``k x k`` into a store at ``path``: every layer with more than ``k^2`` parameters (a smaller one
    is kept exact, as a plan keeps a layer whose exact record is no larger)."""
    x, y, x_test, y_test = data
    run = RunCapture(path, encoding="fp32", budget=Budget("auto", None))
    modules = dict(build_model(setup.kind, setup.seed).named_modules())
    size = {layer: sum(p.numel() for p in modules[layer].parameters(recurse=False)) for layer in layers}
    plan = {layer: "exact" if size[layer] <= k * k else "projected" for layer in layers}  # as the plan keeps them
    run.policy.plan = CapturePlan("auto", None, "benchmark", "fp32", k, dict(plan), dict(plan), 0, setup.epochs, {})
    sources = [
        PassSource("train", TensorDataset(x, y), list(range(len(y))), 256),
        PassSource("test", TensorDataset(x_test, y_test), list(range(len(y_test))), 256),
    ]
    epoch_rate = 0.1 * math.ceil(len(y) / 32)  # the summed rate of an epoch's steps, as the exact passes record
    step = math.ceil(len(y) / 32)

    def on_epoch_end(epoch: int, model: nn.Module) -> None:
        def loss_of(batch: Any, k: int) -> Tensor:
            return F.cross_entropy(model(batch[0]), batch[1])

        run.checkpoint_passes(model, sources, loss_of, name=f"epoch-{epoch}", rank=0, world_size=1,
                              to_device=lambda b: b, step=(epoch + 1) * step, epoch=epoch, lr=epoch_rate)  # fmt: skip

    try:
        train_model(build_model(setup.kind, setup.seed), x, y, epochs=setup.epochs, seed=setup.seed,
                    on_epoch_end=on_epoch_end)  # fmt: skip
    finally:
        run.close()


def projected_scores(
    path: Path, setup: Setup, n: int, method: CurvatureMethod | None, relative_damping: float
) -> np.ndarray:
    """``(N, M + T)`` scores over the projected passes: ``kfac_influence`` (``method``), or TracIn (None)."""
    store, columns = open_store(path), setup.test_samples + setup.tune_samples
    trains = [f"epoch-{e}/train" for e in range(setup.epochs)]
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    if method is None:
        return ordered(store.influence(trains, tests), n, columns)
    return ordered(store.kfac_influence(trains, tests, method=method, relative_damping=relative_damping), n, columns)
