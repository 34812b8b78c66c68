"""``sample_renderer=`` on a real Lightning ``Trainer``: its strings are the texts of the tables, read back from
TensorBoard's event files, for the ids the reports name."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")
pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from metastore_plugins import IndexedDataset, MetaStoreCallback  # noqa: E402

#: the "dataset's texts": what a user's renderer looks up by split and index
TEXTS = {
    split: [f"{split} review {i}: " + "fine " * (i % 5) for i in range(n)] for split, n in (("train", 32), ("val", 8))
}


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def data(n: int, seed: int) -> IndexedDataset:
    generator = torch.Generator().manual_seed(seed)
    return IndexedDataset(
        TensorDataset(torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator))
    )


def test_the_tables_show_what_the_renderer_returns_for_each_id(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []

    def renderer(split: str, i: int) -> str:
        calls.append((split, i))
        return TEXTS[split][i]

    callback = MetaStoreCallback(sample_renderer=renderer, encoding="fp32", report_k=5)
    train = DataLoader(data(32, 1), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        max_epochs=2,
        logger=TensorBoardLogger(tmp_path),
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(does not have many workers|smaller than the logging interval).*")
        trainer.fit(Tiny(), train, DataLoader(data(8, 2), batch_size=8))
    result = callback.report_result
    assert result is not None and calls
    assert [row["text"] for row in result["outliers"]] == [
        TEXTS["train"][row["sample_id"]] for row in result["outliers"]
    ]
    events = EventAccumulator(trainer.log_dir, size_guidance={"tensors": 0}).Reload()
    table = events.Tensors("metastore/influence/text_summary")[0].tensor_proto.string_val[0].decode()
    shown = [line.split("|") for line in table.splitlines() if line.startswith(("| + |", "| - |"))]
    assert len(shown) == sum(len(row["proponents"]) + len(row["opponents"]) for row in result["influence"])
    for cells in shown:  # | sign | train id | label | score | text |
        assert cells[5].strip() == " ".join(TEXTS["train"][int(cells[2])].split())
    for row in result["influence"]:
        heading = f"**test {row['test_id']}** (label {row['test_label']}, prediction {row['test_prediction']}"
        assert f"{heading}; exact scores): " + " ".join(TEXTS["val"][row["test_id"]].split()) in table
