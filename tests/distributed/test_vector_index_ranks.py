"""Top-k with ``k=`` under ``torch.distributed`` (2 gloo ranks): the same proponents and opponents as one process.

A partitioned store accepts ``k=`` and ``index=``: each rank builds and keeps the index of its own shards, the
ranks' candidates are pooled and only they are scored (partitioned); one process scores its whole index's
candidates. References: one process, exhaustive and through the index.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from ddp_store import run_ranks, write_ddp_store

from metastore_plugins import open_store
from metastore_plugins.core.distributed import open_distributed_store
from metastore_plugins.core.store.vectors import vector_files

TRAIN = ["epoch-0/train", "epoch-1/train"]
VAL = ["epoch-0/val", "epoch-1/val"]
K = 3

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)


def _top(rank: int, world: int, out: Path) -> str:
    store = open_distributed_store(out.parent / "store")
    scores = store.influence(TRAIN, VAL, k=K, index=True, candidates=4)
    (out / f"got{rank}.pkl").write_bytes(pickle.dumps(scores.top(K)))
    (out / f"rows{rank}.pkl").write_bytes(pickle.dumps(sorted(scores.row_ids.tolist())))
    again = store.influence(TRAIN, VAL, k=K, candidates=4)  # index=None: the ranks' kept indexes
    (out / f"kept{rank}.pkl").write_bytes(pickle.dumps(again.top(K)))
    return "done"


def ids_and_scores(top: list[dict]) -> list[tuple[list[int], list[float]]]:
    """Per test sample, its top-k ids (sorted: no order among ties) and scores (sorted)."""
    rows = []
    for entry in top:
        pairs = entry["proponents"] + entry["opponents"]
        rows.append((sorted(i for i, _ in pairs), sorted(s for _, s in pairs)))
    return rows


def test_two_ranks_give_the_top_k_of_one_process(tmp_path: Path) -> None:
    store_dir = write_ddp_store(tmp_path / "store")
    results = run_ranks(_top, 2, tmp_path / "out")
    assert all(results.get(rank, {}).get("ok") == "done" for rank in range(2)), results
    one = open_store(store_dir)
    manifests = [m for m in vector_files.manifest_keys(store_dir) if vector_files.read_manifest(store_dir, m)]
    per_rank = [vector_files.read_manifest(store_dir, m) for m in manifests]
    assert sum(1 for m in per_rank if m and m.get("shards")) == 2 * len(TRAIN)  # each rank's own, per pass
    every = len(one.influence(TRAIN, VAL).row_ids)
    indexed = ids_and_scores(one.influence(TRAIN, VAL, k=K, index=True).top(K))
    assert [ids for ids, _ in indexed] == [ids for ids, _ in ids_and_scores(one.influence(TRAIN, VAL).top(K))]
    for rank in range(2):
        for name in ("got", "kept"):
            got = ids_and_scores(pickle.loads((tmp_path / "out" / f"{name}{rank}.pkl").read_bytes()))
            assert [ids for ids, _ in got] == [ids for ids, _ in indexed]
            for (_, a), (_, b) in zip(got, indexed):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        rows = pickle.loads((tmp_path / "out" / f"rows{rank}.pkl").read_bytes())
        assert len(rows) < every  # only the ranks' candidates were scored
    assert rows == pickle.loads((tmp_path / "out" / "rows0.pkl").read_bytes())
    assert one.verify() == []
    shards = sum(len({ref.file.name for ref in one.batch_refs(point)}) for point in TRAIN)
    assert len(list((store_dir / vector_files.FOLDER).glob("part-*"))) == shards  # the ranks' and the whole share
