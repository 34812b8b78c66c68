"""Preconditioned and kernel self-influence of a ``DistributedStore`` (2 gloo processes, each reading its shards)
equal the single-process queries on a 2-rank DDP store.

Tolerance: fp32 round-off, ``1e-6`` of the largest reference value (tests/README.md); sums over ranks
are added in another order.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ddp_store import assert_close, run_ranks, write_ddp_store

from metastore_plugins import open_store
from metastore_plugins.core.analysis.curvature_self import kernel_self_influence, preconditioned_self_influence
from metastore_plugins.core.distributed import open_distributed_store

TRAIN = ["epoch-0/train", "epoch-1/train"]

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)


def _ask(store: Any) -> dict[str, np.ndarray]:
    return {
        "ekfac": preconditioned_self_influence(store, TRAIN),
        "kfac_some": preconditioned_self_influence(store, TRAIN[1], method="kfac", sample_ids=range(0, 40, 3)),
        "kernel": kernel_self_influence(store, TRAIN, dim=2, cache=False),
    }


def _queries(rank: int, world: int, out: Path) -> str:
    (out / f"got{rank}.pkl").write_bytes(pickle.dumps(_ask(open_distributed_store(out.parent / "store"))))
    return "done"


def test_curvature_self_influence_equals_one_process(tmp_path: Path) -> None:
    store_dir = write_ddp_store(tmp_path / "store")
    out = store_dir.parent / "out"
    ranks = run_ranks(_queries, 2, out)
    for rank in range(2):
        assert ranks.get(rank, {}).get("ok") == "done", ranks.get(rank)
    alone = _ask(open_store(store_dir))
    assert len(alone["kfac_some"]) == len(open_store(store_dir).sample_ids(TRAIN[1], sample_ids=range(0, 40, 3)))
    for rank in range(2):
        got = pickle.loads((out / f"got{rank}.pkl").read_bytes())
        for name, expected in alone.items():
            assert got[name].shape == expected.shape
            assert_close(got[name], expected)
