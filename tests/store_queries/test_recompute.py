"""Weight snapshots and exact recomputation: torch.func per-sample gradients at the snapshot's weights.

The live model is changed after each snapshot, so that recomputing at the live weights would
fail these tests; and it must come back unchanged (weights, ``.grad``, mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins.core.analysis.recompute import recompute
from metastore_plugins.core.capture.records import restore_all
from metastore_plugins.core.ops import total_sq_norms
from metastore_plugins.core.store.manifest import StoreError
from metastore_plugins.core.store.snapshots import SnapshotWriter, list_snapshots, load_snapshot
from metastore_plugins.testing import reference_per_sample_gradients

VOCAB, TOKENS = 30, 6


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(input_ids))).mean(1))


class Items(torch.utils.data.Dataset):
    """Dict items (like a tokenized dataset) of fixed length: ``input_ids`` and ``labels``."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB // 2, (n, TOKENS), generator=g)  # half the vocabulary never seen
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["input_ids"]), batch["labels"])


def _train_a_little(model: nn.Module, data: Items, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        batch = {"input_ids": data.ids[step::4], "labels": data.labels[step::4]}
        optimizer.zero_grad()
        _loss(model, batch).backward()
        optimizer.step()


def test_snapshot_chain_is_bitwise_and_saves_unchanged_rows(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, data = Tagger(), Items(16)
    writer = SnapshotWriter(tmp_path)
    first = writer.write(model, name="epoch-0", step=0, attributes={"loss": 1.5})
    saved0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    _train_a_little(model, data, 2)
    second = writer.write(model, name="epoch-1", step=2)
    saved1 = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert second.base == "epoch-0" and second.nbytes < first.nbytes  # unseen embedding rows are not stored again
    assert not list((tmp_path / "snapshots").glob("*.tmp"))
    for name, saved in (("epoch-0", saved0), ("epoch-1", saved1)):
        loaded = load_snapshot(tmp_path, name)
        assert set(loaded) == set(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (name, key)
    assert [(info.name, info.step, info.attributes) for info in list_snapshots(tmp_path)] == [
        ("epoch-0", 0, {"loss": 1.5}),
        ("epoch-1", 2, {}),
    ]
    (tmp_path / "snapshots" / "epoch-0-rank0.safetensors").unlink()
    with pytest.raises(StoreError, match="base snapshot 'epoch-0' of 'epoch-1' is missing"):
        load_snapshot(tmp_path, "epoch-1")
    with pytest.raises(StoreError, match="the snapshot is missing.*epoch-1"):
        load_snapshot(tmp_path, "epoch-7")


def test_recompute_is_exact_at_the_snapshot_weights(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model, data = Tagger(), Items(20)
    _train_a_little(model, data, 2)
    SnapshotWriter(tmp_path).write(model, name="epoch-0", step=2)
    at_snapshot = Tagger()
    at_snapshot.load_state_dict(model.state_dict())
    _train_a_little(model, data, 3)  # the live weights move on
    model.train()
    live = {k: v.detach().clone() for k, v in model.named_parameters()}
    model.hidden.weight.grad = torch.ones_like(model.hidden.weight)
    ids = [7, 2, 13, 2, 19]  # any order, repeats allowed
    records = recompute(model, data, ids, store_dir=tmp_path, snapshot="epoch-0", batch_size=2)
    batch = {"input_ids": data.ids[ids], "labels": data.labels[ids]}
    expected = reference_per_sample_gradients(at_snapshot.eval(), _loss, batch)
    got = restore_all(records)
    for name, value in expected.items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-7), name
    norms = sum(v.flatten(1).pow(2).sum(1) for v in expected.values())
    assert torch.allclose(total_sq_norms(records), norms, rtol=1e-5)
    for key, value in model.named_parameters():  # the live model is back
        assert torch.equal(value, live[key]), key
    assert model.training and torch.equal(model.hidden.weight.grad, torch.ones_like(model.hidden.weight))


def test_recompute_refuses_a_snapshot_of_another_model(tmp_path: Path) -> None:
    SnapshotWriter(tmp_path).write(nn.Linear(3, 2), name="s", step=0)
    with pytest.raises(StoreError, match="snapshot 's' does not fit this model"):
        recompute(Tagger(), Items(4), [0], store_dir=tmp_path, snapshot="s")
