"""A real 2-process CPU DDP Trainer run; ``torchrun --nproc_per_node 2 trainer_ddp_worker.py OUT``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402
from hf_cases import make_dataset, make_model, train  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback  # noqa: E402

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out = Path(sys.argv[1])
    callback = MetaStoreTrainerCallback(encoding="fp32", checkpoint_train_samples=12)
    train(
        out,
        make_model(),
        make_dataset(20, 1),
        make_dataset(10, 2),
        [callback],
        gradient_accumulation_steps=2,
        ddp_backend="gloo",
        tokenizer=None,
    )
    # the Trainer leaves its process group up; torch asks for it to be destroyed before exit, and without it
    # one rank in about ten aborted while the interpreter shut down ("terminate called without an active
    # exception", no Python frame left), after the run and its reports had finished
    if dist.is_initialized():
        dist.destroy_process_group()
