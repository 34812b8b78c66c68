"""``metastore_plugins.track``: a plain PyTorch loop captured as the callbacks capture a trainer (issue 48).

Each stored per-sample gradient (training steps at their own weights, checkpoint passes at the pass's
weights) is compared with torch.func's (``reference_per_sample_gradients``); the ids with the batches the loop
saw; and the policy, budget and loss check are the callbacks'.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import metastore_plugins
from metastore_plugins import IndexedDataset, open_store
from metastore_plugins.core.errors import StateError
from metastore_plugins.testing import reference_per_sample_gradients

ROOT = Path(__file__).resolve().parents[2]
N_TRAIN, N_VAL, BATCH, D_IN, CLASSES = 28, 12, 8, 6, 5  # 4 batches per epoch, the last one of 4 samples


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def _weights(model: nn.Module) -> nn.Module:
    """A copy of the weights in a model without the capture's hooks (a hooked model holds the writer's locks)."""
    copy = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    copy.load_state_dict(model.state_dict())
    return copy


def _loss(model: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _loaders(train_set: Any) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(3)  # the shuffle does not depend on the global RNG
    train = DataLoader(train_set, batch_size=BATCH, shuffle=True, generator=generator)
    return train, DataLoader(_data(N_VAL, 2), batch_size=BATCH)


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two epochs of SGD (lr 0.1, so every step has its own weights), exact fp32 capture, a pass each epoch."""
    store_dir = tmp_path_factory.mktemp("loop") / "store"
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train, val = _loaders(_data(N_TRAIN, 1))
    seen: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}  # step -> the batch's x, torch.func's gradients
    at_pass: dict[int, nn.Module] = {}
    with metastore_plugins.track(
        model, optimizer, train, val_loader=val, store_dir=store_dir, epochs=2, encoding="fp32", policy="exact"
    ) as run:
        for epoch in range(2):
            for x, y in run.batches():
                seen[run.global_step] = (x.clone(), reference_per_sample_gradients(_weights(model), _loss, (x, y)))
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                run.step(loss)
                optimizer.step()
                optimizer.zero_grad()
            at_pass[epoch] = _weights(model)
            run.checkpoint()
    return {"store": open_store(store_dir), "dir": store_dir, "seen": seen, "at_pass": at_pass, "run": run}


def test_every_step_and_both_passes_are_stored_with_reports(loop_run: dict[str, Any]) -> None:
    store, run = loop_run["store"], loop_run["run"]
    assert store.capture_points() == [
        "epoch-0/train",
        "epoch-0/val",
        "epoch-1/train",
        "epoch-1/val",
        "start/val",
        "train",
    ]
    assert sorted(set(store.metadata("train")["step"].tolist())) == list(range(8))
    assert store.verify() == []
    for name in ("outliers.json", "outliers.md", "influence.json", "summary.json"):
        assert (loop_run["dir"] / "reports" / name).is_file()
    assert run.report_result is not None and len(run.report_result["outliers"]) == 20
    assert run.seconds["passes"] > 0


def test_ids_are_the_samples_of_the_batches_the_loop_saw(loop_run: dict[str, Any]) -> None:
    store, seen = loop_run["store"], loop_run["seen"]
    x_all = _data(N_TRAIN, 1).tensors[0]
    for step, (x, _) in seen.items():
        ids = store.sample_ids("train", steps=step)
        assert torch.equal(x_all[torch.as_tensor(ids)], x)  # ids from the sampler, in the batch's order
    per_epoch = [store.metadata("train")["sample_id"][store.metadata("train")["epoch"] == e] for e in (0, 1)]
    assert [sorted(ids.tolist()) for ids in per_epoch] == [list(range(N_TRAIN))] * 2


def test_each_step_stores_each_samples_own_gradient_at_its_weights(loop_run: dict[str, Any]) -> None:
    store, seen = loop_run["store"], loop_run["seen"]
    for step, (_, expected) in seen.items():
        ids = store.sample_ids("train", steps=step)
        restored = [store.restore(int(i), capture_point="train", step=step) for i in ids]
        for name, want in expected.items():
            got = torch.stack([r[name] for r in restored])  # (B, *shape), the batch's order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    meta = store.metadata("train")
    np.testing.assert_allclose(meta["lr"], 0.1, rtol=1e-7)


def test_checkpoint_passes_store_the_gradients_at_the_pass_weights(loop_run: dict[str, Any]) -> None:
    store = loop_run["store"]
    for epoch, model in loop_run["at_pass"].items():
        for split, data in (("train", _data(N_TRAIN, 1)), ("val", _data(N_VAL, 2))):
            expected = reference_per_sample_gradients(model, _loss, data.tensors)
            for sid in (0, 5, 11):
                got = store.restore(sid, capture_point=f"epoch-{epoch}/{split}")
                for name, want in expected.items():
                    torch.testing.assert_close(got[name], want[sid], rtol=1e-5, atol=1e-6)


def test_the_plan_and_the_budget_are_the_callbacks(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train, val = _loaders(IndexedDataset(_data(N_TRAIN, 1)))  # ids carried by the items, taken off the batch
    with metastore_plugins.track(model, optimizer, train, store_dir=tmp_path / "s", epochs=1, budget="50MB") as run:
        for batch in run.batches():
            assert len(batch) == 2  # (x, y): the index IndexedDataset added is gone
            loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            run.step(loss)
            optimizer.step()
            optimizer.zero_grad()
        run.checkpoint()
    plan = open_store(tmp_path / "s").config["capture_plan"]
    assert (plan["policy"], plan["budget"]) == ("auto", 50_000_000)
    with pytest.raises(ValueError, match=r"track\(budget=1,000 bytes\) is below what this run needs"):
        with metastore_plugins.track(model, optimizer, train, store_dir=tmp_path / "t", epochs=1, budget=1000):
            pass


def test_a_wrong_loss_reduction_is_refused_before_anything_is_stored(tmp_path: Path) -> None:
    model = _model()
    train, _ = _loaders(_data(N_TRAIN, 1))
    with pytest.raises(ValueError, match=r"is the sum of the batch's 8 .*8x too large.*track\(loss_reduction='sum'\)"):
        with metastore_plugins.track(model, None, train, store_dir=tmp_path / "s") as run:  # "mean" by default
            for x, y in run.batches():
                loss = F.cross_entropy(model(x), y, reduction="sum")
                loss.backward()
                run.step(loss)
    assert open_store(tmp_path / "s").capture_points() == []  # nothing stored


def test_a_step_outside_the_batches_is_refused(tmp_path: Path) -> None:
    model = _model()
    train, _ = _loaders(_data(N_TRAIN, 1))
    with metastore_plugins.track(model, None, train, store_dir=tmp_path / "s", reports=False) as run:
        with pytest.raises(StateError, match=r"run\.step\(\) stores the step of a batch from run\.batches\(\)"):
            run.step()


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_quick_start_and_docs_loop_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # their runs/... directories land in this test's directory
    (example,) = _python_blocks(ROOT / "docs" / "loop.md")
    exec(compile(example, "docs/loop.md", "exec"), {})  # noqa: S102 - our own documentation
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "['epoch-0/train', 'epoch-0/val', 'epoch-1/train', 'epoch-1/val', 'start/val', 'train']"
    assert 0 <= int(printed[1]) < 64
    quick_start = next(block for block in _python_blocks(ROOT / "README.md") if "track(" in block)
    model = _model()
    train, val = _loaders(_data(N_TRAIN, 1))
    names = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loader": train}
    exec(compile(quick_start, "README.md", "exec"), {**names, "val_loader": val})  # noqa: S102
    store = open_store(tmp_path / "runs" / "demo" / "store")
    assert sorted(set(store.metadata("train")["epoch"].tolist())) == [0, 1, 2]
    assert (tmp_path / "runs" / "demo" / "store" / "reports" / "outliers.json").is_file()
