"""2 CPU processes (gloo) running the Trainer's event sequence with DDP; ``python hf_ddp_worker.py OUT``."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def run(rank: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    # rendezvous through a file in the test's own directory: no TCP port to agree on (or to collide on)
    init = (Path(out) / "dist-init").resolve().as_uri()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        from hf_cases import make_dataset, make_model, simulate_train

        from metastore_plugins.hf_callback import MetaStoreTrainerCallback

        callback = MetaStoreTrainerCallback(encoding="fp32", checkpoint_train_samples=12)
        simulate_train(
            Path(out),
            make_model(),
            make_dataset(20, 1),
            make_dataset(10, 2),
            [callback],
            accumulation=2,
            rank=rank,
            world_size=2,
        )
        result = callback.report_result or {}  # every rank scored its share of the reports
        kept = {"partition": result.get("partition"), "tags": result.get("tags", [])}
        (Path(out) / f"report-rank{rank}.json").write_text(json.dumps(kept))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.spawn(run, args=(sys.argv[1],), nprocs=2, join=True)
