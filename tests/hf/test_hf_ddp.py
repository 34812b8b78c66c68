"""DDP with 2 CPU processes (gloo): each rank records the ids its sampler shard drew, writes its own shards,
and stores each sample's own gradient; every rank scores its share of the reports and rank zero writes what one
process writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tensorboard")

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # 2 training processes under torch.distributed (gloo)

from hf_cases import make_dataset, make_model, reference_gradient, relative_error  # noqa: E402
from reportcases import assert_shares, assert_tables_match, read_tables  # noqa: E402

from metastore_plugins import open_store  # noqa: E402
from metastore_plugins.core.training.report_pass import report_run  # noqa: E402


def test_two_processes_exact_ids_and_gradients(tmp_path: Path) -> None:
    worker = Path(__file__).parent / "hf_ddp_worker.py"  # its ranks meet through a file under tmp_path, not a port
    done = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    store_dir = tmp_path / "out" / "metastore"
    store = open_store(store_dir)
    assert store.ranks() == [0, 1] and store.verify() == []
    train_set = make_dataset(20, 1)
    meta = store.metadata("train")
    for epoch in (0, 1):
        in_epoch = meta["epoch"] == epoch
        per_rank = [set(meta["sample_id"][in_epoch & (meta["rank"] == r)].tolist()) for r in (0, 1)]
        assert per_rank[0].isdisjoint(per_rank[1]) and per_rank[0] | per_rank[1] == set(range(20))
    assert [train_set[int(i)]["label"] for i in meta["sample_id"]] == meta["label"].tolist()
    model = make_model()  # lr=0: the weights of every step are the initial ones
    for sid, step in list(zip(meta["sample_id"], meta["step"]))[::4]:
        item = train_set[int(sid)]
        stored = store.restore(int(sid), capture_point="train", step=int(step))
        assert relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])) < 1e-4
    passes = store.metadata("epoch-1/train")
    assert len(passes["sample_id"]) == 12 and set(passes["rank"].tolist()) == {0, 1}
    assert sorted(store.sample_ids("epoch-1/val").tolist()) == list(range(10))
    assert (store_dir / "reports" / "outliers.md").is_file()
    ranks = [json.loads((tmp_path / f"report-rank{r}.json").read_text()) for r in (0, 1)]
    assert_shares([r["partition"] for r in ranks])  # rank 1 scored its share, not rank 0 alone
    assert "metastore/gradient_sketches" in ranks[0]["tags"] and ranks[1]["tags"] == []
    alone = report_run(store_dir, tmp_path / "alone")
    assert alone is not None
    assert_tables_match(store_dir, read_tables(store_dir / "reports"), alone)
