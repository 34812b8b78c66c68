"""Exact recomputation at a weight snapshot, against torch.func per-sample gradients at the snapshot's weights.

The reference (``_func_grads``) is ``vmap(grad(loss of one sample))`` over ``functional_call`` of a
copy of the model holding the snapshot's state, written here with no code of the package. After each
snapshot the live model moves on (weights, BatchNorm statistics), and the test first checks that the
live weights give gradients far from the reference: recomputing at them would fail. fp32 throughout:
relative error ``max|a - e| / max|e|`` below ``1e-5`` (tests/README.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.model.recompute import recompute
from metastore_plugins.core.ops import total_dots, total_sq_norms
from metastore_plugins.core.records import restore_all
from metastore_plugins.core.store.snapshots.weights import SnapshotWriter, write_snapshot

TOL = 1e-5
VOCAB, PAD = 30, 0


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.drop = nn.Dropout(0.5)  # off in recompute (eval mode), as in a checkpoint pass

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(torch.tanh(self.norm(self.fc1(x)))))  # (B, 3)


class Tagger(nn.Module):
    """HF-like: ``model(input_ids=, attention_mask=, labels=)`` -> dict with ``logits`` (and ``loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        mask = attention_mask.unsqueeze(-1).float()  # (B, T, 1)
        pooled = (torch.tanh(self.hidden(self.embed(input_ids))) * mask).sum(1) / mask.sum(1)  # (B, 16)
        logits = self.head(pooled)  # (B, 3)
        return {"logits": logits} if labels is None else {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def _mlp_data(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, generator=g), torch.randint(0, 3, (), generator=g)) for _ in range(n)]


def _tagger_data(n: int) -> list[dict[str, Tensor]]:
    """Tokenized items of different lengths (like a HF dataset): ``collate`` pads them."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(2, 7, (n,), generator=g)
    return [
        {
            "input_ids": torch.randint(1, VOCAB // 2, (int(t),), generator=g),
            "labels": torch.randint(0, 3, (), generator=g),
        }
        for t in lengths  # half the vocabulary never seen: row-sparse snapshots
    ]


def collate(items: list[dict[str, Tensor]], length: int | None = None) -> dict[str, Tensor]:
    length = length or max(len(item["input_ids"]) for item in items)
    ids = torch.full((len(items), length), PAD)  # (B, T)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
    return {
        "input_ids": ids,
        "attention_mask": (ids != PAD).long(),
        "labels": torch.stack([i["labels"] for i in items]),
    }


def _func_grads(model: nn.Module, batch: Any, forward: Callable[[nn.Module, Any], Tensor]) -> dict[str, Tensor]:
    """Parameter name -> ``(B, *shape)``: torch.func per-sample gradients of cross-entropy, in eval mode."""
    model = copy.deepcopy(model).eval()
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p: dict[str, Tensor], sample: Any) -> Tensor:
        one = torch.utils._pytree.tree_map(lambda t: t.unsqueeze(0), sample)
        logits = forward(lambda *a, **k: functional_call(model, (p, buffers), a, k), one)  # type: ignore[arg-type]
        return F.cross_entropy(logits, one["labels"] if isinstance(one, dict) else one[1])

    return vmap(grad(loss), in_dims=(None, 0))(params, batch)


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for _, g in sorted(grads.items())], 1)  # (B, P)


def _rel(actual: Tensor, expected: Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def _train(model: nn.Module, batches: list[Any], loss: Callable[[nn.Module, Any], Tensor]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for batch in batches:
        optimizer.zero_grad()
        loss(model, batch).backward()
        optimizer.step()


def _check(records: list[Any], expected: dict[str, Tensor], live: dict[str, Tensor]) -> None:
    """Records equal the reference; the live weights' gradients are far from it (the test can fail)."""
    assert _rel(_flat(live), _flat(expected)) > 1000 * TOL
    got = restore_all(records)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert _rel(got[name], value) < TOL, name
    flat = _flat(expected)  # (B, P)
    assert _rel(total_sq_norms(records), flat.pow(2).sum(1)) < TOL
    assert _rel(total_dots(records, records), flat @ flat.T) < TOL


def _mlp_forward(model: Any, batch: Any) -> Tensor:
    return model(batch[0])


def _mlp_loss(model: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_mlp_on_tuples_is_exact_at_the_snapshot_weights(tmp_path: Path, reduction: LossReduction) -> None:
    model, data = MLP(), _mlp_data(12)
    batches = [torch.utils.data.default_collate(data[k::3]) for k in range(3)]
    _train(model, batches[:2], _mlp_loss)
    write_snapshot(tmp_path, model, name="epoch-0", step=2)
    at_snapshot = copy.deepcopy(model)
    _train(model, batches[2:] * 3, _mlp_loss)  # weights and running statistics move on
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 7.0)
    rng = torch.get_rng_state()

    ids = [7, 2, 11, 2, 0]  # any order, a repeat, batches of two
    records = recompute(
        model, data, ids, store_dir=tmp_path, snapshot="epoch-0", batch_size=2, loss_reduction=reduction
    )
    batch = torch.utils.data.default_collate([data[i] for i in ids])
    _check(records, _func_grads(at_snapshot, batch, _mlp_forward), _func_grads(model, batch, _mlp_forward))
    assert all(torch.equal(value, live[key]) for key, value in model.state_dict().items())  # buffers too
    assert model.training and torch.equal(model.fc1.weight.grad, torch.full_like(model.fc1.weight, 7.0))
    assert model.fc2.weight.grad is None and torch.equal(torch.get_rng_state(), rng)


def _tagger_forward(model: Any, batch: dict[str, Tensor]) -> Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]


def _tagger_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(_tagger_forward(model, batch), batch["labels"])


@pytest.mark.parametrize("loss", ["default", "given"])
def test_an_embedding_model_on_padded_dict_batches_is_exact_at_the_snapshot_weights(tmp_path: Path, loss: str) -> None:
    model, data = Tagger(), _tagger_data(16)
    batches = [collate(data[k::4]) for k in range(4)]
    writer = SnapshotWriter(tmp_path)
    writer.write(model, name="epoch-0", step=0)
    _train(model, batches[:2], _tagger_loss)
    info = writer.write(model, name="epoch-1", step=2)  # row-sparse: unseen tokens did not move
    assert info.base == "epoch-0"
    at_snapshot = copy.deepcopy(model)
    _train(model, batches[2:], _tagger_loss)
    model.eval()
    live = {k: v.detach().clone() for k, v in model.named_parameters()}

    ids = [13, 4, 9, 1]
    loss_fn = None if loss == "default" else lambda m, b: _tagger_loss(m, b) * 3.0  # a loss scaled by 3: undone below
    records = recompute(model, data, ids, store_dir=tmp_path, snapshot="epoch-1", collate_fn=collate, loss_fn=loss_fn)
    scale = 1.0 if loss == "default" else 3.0
    batch = collate([data[i] for i in ids], length=6)  # padded further than recompute's batches: masked out
    expected = {k: scale * v for k, v in _func_grads(at_snapshot, batch, _tagger_forward).items()}
    _check(records, expected, _func_grads(model, batch, _tagger_forward))
    assert not model.training and all(torch.equal(v, live[k]) for k, v in model.named_parameters())


def test_the_live_model_comes_back_when_recompute_fails(tmp_path: Path) -> None:
    model, data = MLP(), _mlp_data(6)
    write_snapshot(tmp_path, model, name="s", step=0)
    with torch.no_grad():
        model.fc2.weight.add_(1.0)
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    calls = []

    def failing(m: nn.Module, batch: Any) -> Tensor:
        calls.append(torch.equal(m.get_parameter("fc2.weight"), live["fc2.weight"]))
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return _mlp_loss(m, batch)

    with pytest.raises(RuntimeError, match="out of memory"):
        recompute(model, data, [0, 1, 2], store_dir=tmp_path, snapshot="s", batch_size=2, loss_fn=failing)
    assert calls == [False, False]  # ran at the snapshot's weights
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(value, live[key]) for key, value in model.state_dict().items())


def test_recompute_errors_name_the_fix(tmp_path: Path) -> None:
    SnapshotWriter(tmp_path).write(nn.Linear(3, 2), name="s", step=0)
    data = _mlp_data(4)
    with pytest.raises(
        StoreError,
        match=r"'s' does not fit this model: parameters not in the snapshot \['fc1.bias', .*not in the model \['bias'",
    ):
        recompute(MLP(), data, [0], store_dir=tmp_path, snapshot="s")
    with pytest.raises(StoreError, match=r"t-rank0\.safetensors: the snapshot is missing \(snapshots of rank 0: s\)"):
        recompute(MLP(), data, [0], store_dir=tmp_path, snapshot="t")
    with pytest.raises(ValueError, match="needs store_dir="):
        recompute(MLP(), data, [0], snapshot="s")
    with pytest.raises(ValueError, match="at least one sample id"):
        recompute(MLP(), data, [], store_dir=tmp_path, snapshot="s")


def test_the_store_method_recomputes_as_the_free_function_and_torch_func(tmp_path: Path) -> None:
    """``store.recompute`` (issue 28, item 13): the query as a method of the store that holds the snapshot."""
    from metastore_plugins import StoreWriter, open_store

    model, data = MLP(), _mlp_data(8)
    batches = [torch.utils.data.default_collate(data[k::2]) for k in range(2)]
    _train(model, batches[:1], _mlp_loss)
    with StoreWriter(tmp_path):  # an (empty) store around the snapshot
        pass
    write_snapshot(tmp_path, model, name="epoch-0", step=1)
    at_snapshot = copy.deepcopy(model)
    _train(model, batches[1:] * 3, _mlp_loss)
    ids = [5, 1, 6]
    records = open_store(tmp_path).recompute(model, data, ids, snapshot="epoch-0", batch_size=2)
    free = recompute(model, data, ids, store_dir=tmp_path, snapshot="epoch-0", batch_size=2)
    batch = torch.utils.data.default_collate([data[i] for i in ids])
    _check(records, _func_grads(at_snapshot, batch, _mlp_forward), _func_grads(model, batch, _mlp_forward))
    got, expected = restore_all(records), restore_all(free)
    assert set(got) == set(expected) and all(_rel(got[n], expected[n]) < TOL for n in expected)
