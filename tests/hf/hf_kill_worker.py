"""A long HF Trainer run with MetaStoreTrainerCallback(flush_seconds=...), killed by test_hf_kill.py;
``python hf_kill_worker.py OUT FLUSH``.

A 12-32-4 MLP on random data, one epoch of 50,000 steps (the kill lands mid-epoch), no evaluation,
checkpoints, reports or checkpoint passes. ``OUT/steps.log`` gets ``start {time}`` when training
starts, then ``{step} {time}`` after each optimizer step, written by a callback that runs after
MetaStoreTrainerCallback has queued the step (flushed to the page cache, which a SIGKILL leaves intact).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from metastore_plugins import MetaStoreTrainerCallback

SAMPLES, BATCH = 400_000, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(SAMPLES, 12, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class StepLog(TrainerCallback):
    """Appends ``{step} {time.time()}`` after each optimizer step; placed after MetaStoreTrainerCallback."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.file.write(f"start {time.time()}\n")
        self.file.flush()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.file.write(f"{state.global_step - 1} {time.time()}\n")  # the step the callback stored it under
        self.file.flush()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out, flush_seconds = Path(sys.argv[1]), float(sys.argv[2])
    torch.manual_seed(0)
    callback = MetaStoreTrainerCallback(
        out / "store", flush_seconds=flush_seconds, reports=False, checkpoint_every_n_evals=0
    )
    args = TrainingArguments(
        output_dir=str(out / "out"),
        per_device_train_batch_size=BATCH,
        learning_rate=0.01,
        num_train_epochs=1,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    trainer = Trainer(model=MLP(), args=args, train_dataset=Data(), callbacks=[callback, StepLog(out / "steps.log")])
    trainer.train()
