"""``torchrun --nproc-per-node 2 -m metastore_plugins.cli influence|similar -k 3 --index build|auto``: the top-k one
process gives, a kept nearest-gradient index or not (tests/distributed/test_vector_index_ranks.py covers
``store.influence(k=)`` on forked gloo ranks; this covers ``similar`` and the command line under torchrun).

Reference: the exhaustive scan in one process (every row scored, ``k=None``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ddp_store import write_ddp_store
from reportcases import assert_top_ranking
from test_torchrun_cli import _torchrun

from metastore_plugins import open_store
from metastore_plugins.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # torchrun with 2 gloo ranks

TRAIN, VAL = ["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"]


@pytest.mark.parametrize("kept", [False, True], ids=["no-index", "kept-index"])
def test_top_k_under_torchrun_is_the_single_process_top_k(
    tmp_path: Path, kept: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    store_dir = write_ddp_store(tmp_path / "store")
    if kept:  # built in one process: the ranks find it kept, and must still give the exhaustive top-k
        for point in TRAIN:
            open_store(store_dir).build_vector_index(point)
    store = open_store(store_dir)
    similar = ["similar", str(store_dir), "--sample", "3", "--json", "-k", "3", "--index"]
    assert main([*similar, "build"]) == 0
    alone = json.loads(capsys.readouterr().out)
    done = _torchrun(*similar, "build" if not kept else "auto")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)  # printed once: by rank 0
    full = store.similar("epoch-1/train", "epoch-1/train", query_ids=[3])
    ranking = [(i, s) for i, s in zip(full.row_ids.tolist(), full.scores[:, 0].tolist()) if i != 3]
    assert len(rows) == len(alone) == 3
    for got in (rows, alone):
        assert_top_ranking([(r["sample_id"], r["cosine"]) for r in got], ranking, 1e-6)

    influence = ["influence", str(store_dir), "--json", "-k", "3", "--index", "build" if not kept else "auto"]
    influence += ["--method", "tracin"]  # the reference is TracIn's scan (--index serves every method since issue 47)
    done = _torchrun(*influence)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert main(influence) == 0
    alone = json.loads(capsys.readouterr().out)
    full = store.influence(TRAIN, VAL)
    tol = 1e-6 * float(np.abs(full.scores).max())
    assert [r["test_id"] for r in rows] == [r["test_id"] for r in alone] == full.col_ids.tolist()
    for j, (row, one) in enumerate(zip(rows, alone)):
        ranking = list(zip(full.row_ids.tolist(), full.scores[:, j].tolist()))
        for side, sign in (("proponents", 1.0), ("opponents", -1.0)):
            for got in (row, one):
                assert_top_ranking(
                    [(p["sample_id"], sign * p["score"]) for p in got[side]], [(i, sign * s) for i, s in ranking], tol
                )
    assert open_store(store_dir).verify() == []  # the ranks left the kept index sound (or wrote none)
