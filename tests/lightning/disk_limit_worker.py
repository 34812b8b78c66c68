"""A Lightning run whose files may not grow past LIMIT bytes (``RLIMIT_FSIZE``: a full disk for one file);
``python disk_limit_worker.py OUT LIMIT``.

The limit is set before anything is written, with SIGXFSZ ignored, so that a write past it fails with
``OSError(EFBIG)`` as a full disk fails with ENOSPC. A 64-256-4 MLP trains 3 epochs of 8 steps (32 samples
each, the rows logged to ``OUT/seen.log`` as in tests/crashcases.py), with a validation loader, fp32 records,
a checkpoint pass every 2 epochs (after epoch 1) and no timer (``flush_seconds=None``): the store writes one
shard at each epoch's end, epoch 0's about 0.6 MB, epoch 1's (steps 8..15 and its pass) about 1.4 MB.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crashcases import seen  # noqa: E402

from metastore_plugins import MetaStoreCallback  # noqa: E402

TRAIN, VAL, BATCH, EPOCHS = 256, 64, 32, 3


class MLP(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
        self.out = out

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if torch.is_grad_enabled() and self.training:
            seen(self.out, batch["row"])
        return F.cross_entropy(self(batch["x"]), batch["labels"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch["x"]), batch["labels"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i], "row": torch.tensor(i)}


if __name__ == "__main__":
    out, limit = Path(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    torch.manual_seed(0)
    callback = MetaStoreCallback(  # passes of the sizes set: the shard sizes the limits below are measured on
        out / "store", encoding="fp32", flush_seconds=None, checkpoint_every_n_epochs=2, attribution_time=None
    )
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(MLP(out), DataLoader(Rows(TRAIN, 1), batch_size=BATCH, shuffle=True), DataLoader(Rows(VAL, 2), 32))
