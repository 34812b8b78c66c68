"""A Hugging Face Trainer run whose model raises (or is interrupted) at step 10; ``python hf_crash_worker.py OUT MODE``.

See tests/crashcases.py: the items carry their row, the model logs each training forward's rows and crashes at
step ``CRASH``; the exception goes through ``trainer.train()`` to the top of this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crashcases import BATCH, SAMPLES, crash, item, seen  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback  # noqa: E402


class MLP(nn.Module):
    def __init__(self, out: Path, mode: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))
        self.out, self.mode = out, mode

    def forward(self, x: Tensor, labels: Tensor, row: Tensor) -> dict[str, Tensor]:
        if self.training and torch.is_grad_enabled():
            crash(self.out, self.mode, seen(self.out, row))
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return item(i)


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out / "out"),
        per_device_train_batch_size=BATCH,
        learning_rate=0.01,
        num_train_epochs=2,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    callback = MetaStoreTrainerCallback(out / "store")  # default flush_seconds (10 s): the run is shorter
    Trainer(model=MLP(out, mode), args=args, train_dataset=Rows(), callbacks=[callback]).train()
