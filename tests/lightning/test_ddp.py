"""DDP with 2 CPU processes (gloo): each rank writes its own shards, ids stay exact, every rank scores its share
of the reports and rank zero writes what one process writes.

The train set is a plain TensorDataset: ids come from what the DistributedSampler of each rank drew.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # 2 training processes under torch.distributed (gloo)

from lightning_cases import Classifier, make_data  # noqa: E402
from reportcases import assert_shares, assert_tables_match, read_tables  # noqa: E402

from metastore_plugins import open_store  # noqa: E402
from metastore_plugins.core.training.report_pass import report_run  # noqa: E402
from metastore_plugins.testing import reference_per_sample_gradients  # noqa: E402


def test_two_cpu_processes_write_their_own_shards_with_exact_ids(tmp_path: Path) -> None:
    worker = Path(__file__).parent / "ddp_worker.py"
    # no inherited rendezvous settings: Lightning asks the OS for a free port (never a fixed one)
    unset = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE"}
    env = {key: value for key, value in os.environ.items() if key not in unset}
    done = subprocess.run(
        [sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    store_dir = tmp_path / "lightning_logs" / "version_0" / "metastore"
    store = open_store(store_dir)
    assert store.ranks() == [0, 1] and store.verify() == []
    assert {p.name.split("-")[0] for p in store_dir.glob("*.safetensors")} == {"rank0", "rank1"}
    x, y = make_data(40, 1).tensors
    meta = store.metadata("train")
    for epoch in (0, 1):
        in_epoch = meta["epoch"] == epoch
        per_rank = [set(meta["sample_id"][in_epoch & (meta["rank"] == r)].tolist()) for r in (0, 1)]
        assert per_rank[0].isdisjoint(per_rank[1]) and per_rank[0] | per_rank[1] == set(range(40))
    np.testing.assert_array_equal(meta["label"], y[meta["sample_id"]].numpy())
    subset = store.metadata("epoch-1/train")
    assert len(subset["sample_id"]) == 16 and set(subset["rank"].tolist()) == {0, 1}
    assert sorted(store.sample_ids("epoch-1/val").tolist()) == list(range(10))
    module = Classifier(lr=0.0)  # lr=0: the weights of every step are the initial ones
    expected = reference_per_sample_gradients(module.net, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y))
    for sid in store.sample_ids("train", steps=3)[:3]:
        got = store.restore(int(sid), capture_point="train", step=3)
        for name, want in expected.items():
            torch.testing.assert_close(got[f"net.{name}"], want[sid], rtol=1e-5, atol=1e-6)
    assert (store_dir / "reports" / "outliers.md").is_file()
    assert len(list((tmp_path / "lightning_logs" / "version_0").glob("events.out.tfevents.*"))) >= 1
    ranks = [json.loads((tmp_path / f"report-rank{r}.json").read_text()) for r in (0, 1)]
    assert_shares([r["partition"] for r in ranks])  # rank 1 scored its share, not rank 0 alone
    assert {"metastore/gradient_sketches", "metastore/exploding_fraction"} <= set(ranks[0]["tags"])
    assert ranks[1]["tags"] == []  # rank 1 logged nothing
    alone = report_run(store_dir, tmp_path / "alone")
    assert alone is not None
    assert_tables_match(store_dir, read_tables(store_dir / "reports"), alone)
