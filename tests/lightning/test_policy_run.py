"""Capture policies on real Lightning runs: the budget holds, the plan is recorded, tags keep steps exact.

The model reads token sequences (12 rows per sample), so that exact factors cost more than a
projection and a budget makes the plan project. Learning rate 0 keeps the weights fixed: every
stored gradient can be checked against torch.func at the initial weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning_cases import fit  # noqa: E402
from netcases import NetModule  # noqa: E402

from metastore_plugins import IndexedDataset, MetaStoreCallback, open_store  # noqa: E402
from metastore_plugins.cli import main as cli_main  # noqa: E402
from metastore_plugins.core.records import restore_all  # noqa: E402
from metastore_plugins.testing import reference_per_sample_gradients  # noqa: E402

TOKENS, D_IN, HIDDEN, CLASSES, N, BATCH = 12, 24, 32, 3, 48, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inp(x)).mean(1))


class Sequences(NetModule):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(Net(), lr=0.0)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, TOKENS, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


class TagAtStart(Callback):
    """Tags steps 2..3 keep="exact" from the first training batch, as user code would."""

    def __init__(self, store: MetaStoreCallback) -> None:
        self.store = store

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 0 and batch_idx == 0:
            self.store.tag("spike", steps=(2, 3), keep="exact", reason="look closely")


def _run(tmp_path: Path, **settings: Any) -> tuple[MetaStoreCallback, Any]:
    callback = MetaStoreCallback(encoding="fp32", **settings)
    train = DataLoader(IndexedDataset(_data(N, 1)), batch_size=BATCH, shuffle=False)
    val = DataLoader(IndexedDataset(_data(16, 2)), batch_size=BATCH)
    module = Sequences()
    fit(tmp_path, module, train, val, [TagAtStart(callback), callback])
    return callback, module


@pytest.mark.filterwarnings("ignore:the report figure.* leaves no room for them")  # the budget leaves them out
def test_a_tagged_range_is_kept_exact_under_a_budget_that_projects(tmp_path: Path) -> None:
    callback, module = _run(tmp_path, budget="400kB")
    store = open_store(callback.dirpath)
    plan = store.config["capture_plan"]
    assert plan["train"]["net.inp"] == "projected" and plan["budget"] == 400_000
    data = _data(N, 1)
    for batch in store.select("train").batches():
        kinds = {record.layer: record.kind for record in batch.records}
        step = batch.ref.step
        if 2 <= step <= 3:  # tagged: exact, and equal to torch.func's per-sample gradients
            assert kinds["net.inp"] == "outer", (step, kinds)
            ids = batch.meta["sample_id"].long()
            expected = reference_per_sample_gradients(
                module.net, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (data.tensors[0][ids], data.tensors[1][ids])
            )
            got = restore_all(batch.records)
            for name, value in expected.items():
                assert torch.allclose(got[f"net.{name}"], value, rtol=1e-4, atol=1e-6), (step, name)
        else:
            assert kinds["net.inp"] == "projected", (step, kinds)
    (found,) = store.find(tag="spike", reason="look closely")
    assert found["steps"] == (2, 3) and found["keep"] == "exact" and found["capture_points"] == ["train"]
    start, *passes = store.find(checkpoint=True)
    assert start["name"] == "start" and start["steps"] == (0, 0) and not start["snapshots"]  # validation samples only
    assert [p["name"] for p in passes] == ["epoch-0", "epoch-1"]
    assert all(p["snapshots"] == [p["name"]] for p in passes) and "val_loss" in passes[-1]["attributes"]


@pytest.mark.filterwarnings("ignore:.*a tag asks to keep step .* which does not fit the budget")  # it says so
def test_a_tiny_budget_is_never_exceeded_and_the_plan_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    budget = 70_000  # steps and passes kept as norms, then lowered as the run outgrows its plan
    with pytest.warns(UserWarning, match="outgrew its capture plan"):
        callback, _ = _run(tmp_path, budget=budget, reports=False)
    on_disk = sum(f.stat().st_size for f in Path(callback.dirpath).rglob("*") if f.is_file())
    assert on_disk <= budget, on_disk
    manifest = json.loads((Path(callback.dirpath) / "manifest-rank0.json").read_text())
    plan = manifest["config"]["capture_plan"]
    assert plan["budget"] == budget and plan["degraded"]
    assert cli_main(["inspect", str(callback.dirpath)]) == 0
    text = capsys.readouterr().out
    assert "capture plan: policy 'auto', budget" in text and "degraded at step" in text
    assert "spike" in text and "steps 2..3, keep exact (reason=look closely)" in text


def test_policy_exact_keeps_every_layer_exact(tmp_path: Path) -> None:
    callback, _ = _run(tmp_path, policy="exact", reports=False)
    store = open_store(callback.dirpath)
    kinds = {record.kind for batch in store.select().batches() for record in batch.records}
    assert kinds <= {"outer", "dense"} and store.config["capture_plan"]["snapshots"] == 0
    assert not (Path(callback.dirpath) / "snapshots").exists()
