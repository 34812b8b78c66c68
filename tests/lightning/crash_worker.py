"""A Lightning run whose training step raises (or is interrupted) at step 10; ``python crash_worker.py OUT MODE``.

See tests/crashcases.py: the items carry their row, the training step logs its rows and crashes at step
``CRASH``; the exception goes through ``trainer.fit()`` (its ``on_exception`` event) to the top of this script.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crashcases import BATCH, SAMPLES, crash, item, seen  # noqa: E402

from metastore_plugins import MetaStoreCallback  # noqa: E402


class MLP(L.LightningModule):
    def __init__(self, out: Path, mode: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))
        self.out, self.mode = out, mode

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        crash(self.out, self.mode, seen(self.out, batch["row"]))
        return F.cross_entropy(self(batch["x"]), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return item(i)


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MetaStoreCallback(out / "store")],
    )
    trainer.fit(MLP(out, mode), DataLoader(Rows(), batch_size=BATCH, shuffle=True))
