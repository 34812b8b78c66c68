"""Tiny Lightning modules and data, a recorder callback and a fit helper for the callback tests."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from metastore_plugins import IndexedDataset

D_IN, CLASSES = 6, 10


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


class Classifier(L.LightningModule):
    """``(x, y)`` batches, mean cross-entropy, SGD."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same weights whatever ran before; the global RNG is left alone
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, CLASSES))
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DictClassifier(Classifier):
    """Dict batches ``{"x", "labels", "idx"}`` (ids carried by the data itself)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.cross_entropy(self(batch["x"]), batch["labels"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


class DictData(torch.utils.data.Dataset):
    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = self.base[i]
        return {"x": x, "labels": y, "idx": i}


def loaders(n_train: int = 40, n_val: int = 12, batch_size: int = 8, **kwargs: Any) -> tuple[DataLoader, DataLoader]:
    """Shuffled train loader (its own seeded generator: the order does not depend on the global RNG), val loader."""
    kwargs.setdefault("generator", torch.Generator().manual_seed(3))
    train = DataLoader(IndexedDataset(make_data(n_train, 1)), batch_size=batch_size, shuffle=True, **kwargs)
    val = DataLoader(IndexedDataset(make_data(n_val, 2)), batch_size=batch_size)
    return train, val


class Recorder(Callback):
    """Placed before MetaStoreCallback: sees the ids IndexedDataset added, and ``.grad`` before each step."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}  # epoch -> ids in loader order
        self.grads: dict[int, dict[str, Any]] = {}  # global step -> parameter name -> .grad

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.ids.setdefault(trainer.current_epoch, []).extend(batch[-1].tolist())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.grads[trainer.global_step] = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def fit(tmp_path: Path, module: Any, train: Any, val: Any, callbacks: list[Any], **trainer_kwargs: Any) -> Any:
    options = {
        "max_epochs": 2,
        "logger": TensorBoardLogger(tmp_path),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        **trainer_kwargs,
    }
    trainer = L.Trainer(callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(does not have many workers|smaller than the logging interval|LeafSpec).*")
        trainer.fit(module, train, val)
    return trainer
