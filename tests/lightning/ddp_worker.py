"""A 2-process CPU DDP run (gloo) with MetaStoreCallback; run by test_ddp.py as ``python ddp_worker.py OUT``."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from lightning_cases import Classifier, loaders, make_data  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from metastore_plugins import MetaStoreCallback  # noqa: E402

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out = Path(sys.argv[1])
    _, val = loaders(40, 10, 5)
    train = DataLoader(make_data(40, 1), batch_size=5, shuffle=True)  # plain: ids from the DistributedSampler
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=TensorBoardLogger(out),
        callbacks=[callback := MetaStoreCallback(encoding="fp32", checkpoint_train_samples=16)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier(lr=0.0), train, val)
    result = callback.report_result or {}  # every rank scored its share of the reports
    kept = {"partition": result.get("partition"), "tags": result.get("tags", [])}
    (out / f"report-rank{trainer.global_rank}.json").write_text(json.dumps(kept))
    if dist.is_initialized():  # before exit, as torch asks (tests/hf/trainer_ddp_worker.py says why)
        dist.destroy_process_group()
