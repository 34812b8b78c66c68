"""MetaStoreCallback observes and never disturbs: a seeded run ends the same with and without it.

Default settings (checkpoint passes after every epoch, reports at the end), ``shuffle=True``,
dropout on, 2 epochs: bit-identical weights, identical logged losses, and every random number
generator (torch, numpy, python ``random``) where the run without the callback left it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

L = pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning_cases import CLASSES, D_IN, Classifier, DictData, fit, make_data  # noqa: E402

from metastore_plugins import IndexedDataset, MetaStoreCallback, open_store  # noqa: E402


class DropoutClassifier(Classifier):
    """Dropout in training; ``(x, y)`` or ``{"x", "labels", ...}`` batches; SGD that moves the weights."""

    def __init__(self) -> None:
        super().__init__(lr=0.2)
        self.net = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, CLASSES))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = (batch["x"], batch["labels"]) if isinstance(batch, dict) else (batch[0], batch[1])  # an index may follow
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss


class LoggedLosses(Callback):
    """The training loss Lightning logged at every step, as it logged it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _rng_states() -> tuple[Tensor, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _run(tmp_path: Path, data: str, with_callback: bool) -> tuple[dict[str, Tensor], list[float], Any]:
    L.seed_everything(7, verbose=False)
    base = make_data(40, 1)
    workers = {"num_workers": 2} if data == "plain, 2 workers" else {}
    train_set = {"dict with idx": DictData(base), "IndexedDataset": IndexedDataset(base)}.get(data, base)
    train = DataLoader(train_set, batch_size=6, shuffle=True, **workers)
    val = DataLoader(make_data(12, 2), batch_size=8)
    module, logged = DropoutClassifier(), LoggedLosses()
    callbacks: list[Any] = [logged] + ([MetaStoreCallback(dirpath=tmp_path / "store")] if with_callback else [])
    trainer = fit(tmp_path, module, train, val, callbacks, max_epochs=2)
    assert "process_dataloader" not in vars(trainer.strategy)  # the callback's wrapper went with fit
    weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    return weights, logged.losses, _rng_states()


@pytest.mark.parametrize("data", ["plain", "IndexedDataset", "dict with idx", "plain, 2 workers"])
def test_the_callback_does_not_change_the_run(tmp_path: Path, data: str) -> None:
    plain_weights, plain_losses, plain_rng = _run(tmp_path / "without", data, with_callback=False)
    weights, losses, rng = _run(tmp_path / "with", data, with_callback=True)
    assert len(losses) == len(plain_losses) == 2 * 7
    assert losses == plain_losses
    for name, value in plain_weights.items():
        assert torch.equal(weights[name], value), name
    assert torch.equal(rng[0], plain_rng[0])
    assert np.array_equal(rng[1][1], plain_rng[1][1]) and rng[1][2:] == plain_rng[1][2:]  # numpy's key and position
    assert rng[2] == plain_rng[2]
    store = open_store(tmp_path / "with" / "store")  # and it did observe: every step, both passes, the reports
    assert store.capture_points() == [
        "epoch-0/train",
        "epoch-0/val",
        "epoch-1/train",
        "epoch-1/val",
        "start/val",
        "train",
    ]
    meta = store.metadata("train")
    for epoch in (0, 1):
        assert sorted(meta["sample_id"][meta["epoch"] == epoch].tolist()) == list(range(40))
    np.testing.assert_array_equal(meta["label"], make_data(40, 1).tensors[1][meta["sample_id"]].numpy())
    assert (tmp_path / "with" / "store" / "reports" / "summary.json").is_file()
