"""2 CPU processes (gloo) running into one store directory three times: a first run, a fresh second run (every
rank must refuse), and a third with ``overwrite=True`` (every rank must follow rank 0's move);
``python rerun_ddp_worker.py OUT`` writes what each rank saw to ``OUT/rerun-rank{r}.json``."""

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
    init = (Path(out) / "dist-init").resolve().as_uri()  # rendezvous through a file: no TCP port
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        from hf_cases import make_dataset, make_model, simulate_train

        from metastore_plugins.core.errors import ExistingStoreError
        from metastore_plugins.hf_callback import MetaStoreTrainerCallback

        def once(**settings: object) -> str:
            callback = MetaStoreTrainerCallback(reports=False, checkpoint_every_n_evals=0, **settings)
            try:
                simulate_train(
                    Path(out), make_model(), make_dataset(8, 1), make_dataset(4, 2), [callback], epochs=1,
                    rank=rank, world_size=2, evaluate=False,
                )  # fmt: skip
            except ExistingStoreError as exc:
                return f"refused: {exc}"
            return "ran"

        seen = {"first": once(), "second": once()}
        dist.barrier()
        if rank == 0:  # what the store holds before the overwrite
            store = Path(out) / "out" / "metastore"
            seen["before"] = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())
        seen["third"] = once(overwrite=True)
        (Path(out) / f"rerun-rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.spawn(run, args=(sys.argv[1],), nprocs=2, join=True)
