"""The harness's row for a user who adds the one line: ``MetaStoreCallback()`` with every default, then one call.

The task's model is trained by Lightning with the same recipe as :func:`.digits.train_model` (mean
cross-entropy, SGD with momentum, batches of 32 in the seeded order ``torch.randperm(N, generator)`` of each
epoch), the callback given nothing but ``dirpath`` (so its budget, policy, passes, reports and encoding are the
defaults), the test samples as the validation set. The row scores ``store.influence(test=<every val pass>,
method="auto")``, the default answer (:mod:`metastore_plugins.core.analysis.default_answer`): every training
sample, from the passes where they hold it, from its steps otherwise.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from metastore_plugins import MetaStoreCallback, open_store
from metastore_plugins.core.analysis import DefaultScores
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING

from .lds_peers import pick
from .lds_setup import Setup, ordered
from .lds_tasks import build_model

BATCH, LR, MOMENTUM = 32, 0.1, 0.9  # :func:`.digits.train_model`'s defaults
ROW = "Default answer: MetaStoreCallback() with every default (Lightning), influence(test=..., method='auto')"


class SeededBatches(Sampler[list[int]]):
    """The batches :func:`.digits.train_model` trains on: ``torch.randperm(n, generator)`` split in 32s per epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.generator = n, torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[list[int]]:
        yield from (rows.tolist() for rows in torch.randperm(self.n, generator=self.generator).split(BATCH))

    def __len__(self) -> int:
        return -(-self.n // BATCH)


class TaskModule(L.LightningModule):
    """The harness's model for ``kind`` under Lightning: mean cross-entropy, SGD with momentum."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def train_with_defaults(setup: Setup, data: tuple[Tensor, Tensor, Tensor, Tensor], root: Path) -> tuple[Path, float]:
    """Fit the task under ``MetaStoreCallback(dirpath=...)`` (every other setting its default): the store and the
    fit's wall seconds (reports included)."""
    x, y, x_test, y_test = data
    module = TaskModule(build_model(setup.kind, setup.seed))
    train = DataLoader(TensorDataset(x, y), batch_sampler=SeededBatches(len(y), setup.seed))
    val = DataLoader(TensorDataset(x_test, y_test), batch_size=256)
    store_dir = root / "store"
    trainer = L.Trainer(
        max_epochs=setup.epochs,
        callbacks=[MetaStoreCallback(dirpath=store_dir)],
        default_root_dir=root,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    started = time.perf_counter()
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's few-workers and log-dir notices
        lightning_logger.setLevel(logging.ERROR)
        try:
            trainer.fit(module, train, val)
        finally:
            lightning_logger.setLevel(level)  # the process's later Lightning runs log as before (tests share it)
    return store_dir, time.perf_counter() - started


def default_answer(store_dir: Path) -> DefaultScores:
    """The default answer over every validation pass the store holds, in step order."""
    store = open_store(store_dir)
    tests = sorted((p for p in store.capture_points() if p.endswith("/val")), key=lambda p: store.steps(p)[0])
    return store.influence(test=tests, method="auto")


def defaults_attributors(
    setup: Setup, data: tuple[Tensor, Tensor, Tensor, Tensor], tmp: Path, plain_seconds: float
) -> dict[str, dict[str, Any]]:
    """``{ROW: row}`` as :func:`.lds.run` keeps rows (scores ``(N, M)``, seconds with the fit's cost beyond the
    plain training, the training samples with a score, the rows by the side(s) that scored them, the plan the
    defaults made)."""
    store_dir, seconds = train_with_defaults(setup, data, tmp / "defaults")
    n, m = len(data[1]), setup.test_samples
    answers: list[DefaultScores] = []

    def scores(_: float) -> np.ndarray:
        answers.append(default_answer(store_dir))
        return ordered(answers[-1], n, setup.test_samples + setup.tune_samples)  # (N, M + T)

    row = pick((DEFAULT_RELATIVE_DAMPING,), scores, m, None)
    plan = open_store(store_dir).config["capture_plan"]
    row.update(
        seconds=seconds - plain_seconds + row["seconds"],
        query_seconds=row["seconds"],
        trainings=1,
        samples_scored=int((np.abs(row["scores"]).sum(1) > 0).sum()),  # of N: rows not all zero
        sources=dict(sorted(Counter(str(side) for side in answers[-1].sources).items())),  # rows by side
        plan={"steps": plan["train"], "passes": plan["passes"], "k": plan["k"], "encoding": plan["encoding"]},
    )
    return {ROW: row}
