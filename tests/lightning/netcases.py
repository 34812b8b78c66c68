"""A LightningModule around any classifier network (tests/lightning/test_budget_grid.py, test_policy_run.py)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class NetModule(L.LightningModule):
    """``(x, y)`` batches through ``net`` (its layers are named ``net.*``), mean cross-entropy, SGD at ``lr``;
    validation logs ``val_loss``."""

    def __init__(self, net: nn.Module, lr: float) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
