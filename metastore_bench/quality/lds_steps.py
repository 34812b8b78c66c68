"""The store's rows from the training steps as a budgeted run keeps them, and the one-call default answer.

:mod:`.lds` measures in-run influence on an exact store. A run under the default policy with a byte budget keeps
its training steps *projected* ``k x k`` per layer, on the top of the latest checkpoint's K-FAC eigenbasis
(seeded before the first pass), fitted at each checkpoint from the pass's first training samples
(``basis_from="checkpoint"``, the default) or from the steps' own K-FAC sums (``"steps"``); its checkpoint
passes cover the default ``checkpoint_train_samples`` (256, drawn once, seeded) of the training set and the
test samples. This module trains the task once more (same seed, data order and optimiser as
:func:`.digits.train_model`: the same run) under ``RunCapture`` with every step captured, and scores
``in_run_influence(method="ekfac")`` (every sample from its steps) and ``influence(test=..., method="auto")``
(the default answer: the passes' samples from the passes, the others from their steps).
"""

from __future__ import annotations

import math
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import TensorDataset

from metastore_plugins import open_store
from metastore_plugins.core.model.pass_sources import CheckpointSchedule, PassSource
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.training.run import RunCapture

from .lds_peers import pick, timed
from .lds_setup import Setup, ordered
from .lds_tasks import build_model

BATCH, LR, MOMENTUM = 32, 0.1, 0.9  # :func:`.digits.train_model`'s defaults


def capture_steps(
    setup: Setup,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    layers: list[str],
    k: int,
    path: Path,
    basis_from: Literal["checkpoint", "steps"],
    exact: bool = False,
) -> None:
    """Train as :func:`.lds.run` does with every step captured ``k x k`` on the eigenbasis (``exact``: every layer
    exact, as a budget that fits them keeps them), and epoch-end passes ``epoch-e/train`` (the default 256 training
    samples) and ``epoch-e/test`` into a store at ``path``."""
    x, y, x_test, y_test = data
    run = RunCapture(path, encoding="fp32", budget=Budget("auto", None))
    run.basis_from(basis_from)
    model = build_model(setup.kind, setup.seed)
    size = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in model.named_modules()}
    plan = {
        layer: "exact" if exact or size[layer] <= k * k else "projected" for layer in layers
    }  # as a plan keeps them
    run.policy.plan = CapturePlan("auto", None, "benchmark", "fp32", k, dict(plan), dict(plan), 0, setup.epochs, {})
    subset = CheckpointSchedule().train_subset(len(y))
    sources = [
        PassSource("train", TensorDataset(x, y), subset, 256),
        PassSource("test", TensorDataset(x_test, y_test), list(range(len(y_test))), 256),
    ]
    per_epoch = math.ceil(len(y) / BATCH)
    generator = torch.Generator().manual_seed(setup.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    step = 0
    model.train()
    try:
        for epoch in range(setup.epochs):
            for rows in torch.randperm(len(y), generator=generator).split(BATCH):
                run.begin_step(model)
                loss = F.cross_entropy(model(x[rows]), y[rows])
                loss.backward()
                run.end_backward()
                run.finish_step((x[rows], y[rows]), rows, step=step, lr=LR, batch_loss=loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1

            def loss_of(batch: Any, _: int) -> Tensor:
                return F.cross_entropy(model(batch[0]), batch[1])

            run.checkpoint_passes(model, sources, loss_of, name=f"epoch-{epoch}", rank=0, world_size=1,
                                  to_device=lambda b: b, step=step, epoch=epoch, lr=LR * per_epoch)  # fmt: skip
    finally:
        run.close()


def steps_scores(path: Path, setup: Setup, n: int, default_answer: bool, relative_damping: float) -> np.ndarray:
    """``(N, M + T)``: in-run EK-FAC over the steps (``default_answer`` False), or ``influence(test=...,
    method="auto")`` (True; its default damping)."""
    store, columns = open_store(path), setup.test_samples + setup.tune_samples
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    if default_answer:
        return ordered(store.influence(test=tests, method="auto"), n, columns)
    return ordered(store.in_run_influence(tests, method="ekfac", relative_damping=relative_damping), n, columns)


def steps_attributors(
    setup: Setup,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    layers: list[str],
    tmp: Path,
    plain_seconds: float,
    k: int = 16,
) -> dict[str, dict[str, Any]]:
    """The rows of :func:`steps_scores` on a ``k x k`` capture of each basis source: ``{name: row}`` as
    :func:`.lds.run` keeps them (scores ``(N, M)``, seconds with the capture's cost, the damping picked), or
    ``{"error"}`` where the store refuses (one epoch: every step came before the first basis, kept seeded)."""
    n, m, rows = len(data[1]), setup.test_samples, {}
    for basis, exact in (("checkpoint", False), ("steps", False), ("checkpoint", True)):
        path = tmp / f"steps-{basis}-{exact}"
        _, seconds = timed(partial(capture_steps, setup, data, layers, k, path, basis, exact))
        cost = seconds - plain_seconds
        answer = "Default answer: influence(test=..., method='auto'), "
        wanted = [(True, f"{answer}exact steps + 256-sample passes")]
        if not exact:
            wanted = [(False, f"EK-FAC in-run (steps projected {k}x{k} on the eigenbasis, basis_from={basis!r})")]
        if basis == "checkpoint" and not exact:
            wanted.append((True, f"{answer}steps {k}x{k} + 256-sample passes"))
        for default, name in wanted:
            try:
                row = pick((DEFAULT_RELATIVE_DAMPING,), partial(steps_scores, path, setup, n, default), m, None)
            except Exception as error:  # noqa: BLE001  (what the store refuses here is reported, as a peer's failure)
                rows[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)}
                continue
            row.update(seconds=cost + row["seconds"], query_seconds=row["seconds"], trainings=1)
            rows[name] = row
    return rows
