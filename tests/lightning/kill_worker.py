"""A long Lightning run with MetaStoreCallback(flush_seconds=...), killed by test_kill.py;
``python kill_worker.py OUT FLUSH``.

A 12-32-4 MLP on random data, one epoch of 50,000 steps (the kill lands mid-epoch), no reports, no checkpoint
passes. ``OUT/steps.log`` gets ``start {time}`` when training starts, then ``{step} {time}`` after each
optimizer step, written by a callback that runs after MetaStoreCallback has queued the step (flushed
to the page cache, which a SIGKILL leaves intact).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from metastore_plugins import MetaStoreCallback

SAMPLES, BATCH = 400_000, 8


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepLog(Callback):
    """Appends ``{step} {time.time()}`` after each step; placed after MetaStoreCallback."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)
        self.step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.file.write(f"start {time.time()}\n")
        self.file.flush()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step  # the step MetaStoreCallback stores this batch under

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.file.write(f"{self.step} {time.time()}\n")
        self.file.flush()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out, flush_seconds = Path(sys.argv[1]), float(sys.argv[2])
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 12, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))
    train = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2))
    callback = MetaStoreCallback(out / "store", flush_seconds=flush_seconds, reports=False, checkpoint_every_n_epochs=0)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[callback, StepLog(out / "steps.log")],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(), train)
