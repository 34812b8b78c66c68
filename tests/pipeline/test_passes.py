"""capture_step and checkpoint_pass: what reaches the store is each sample's own gradient, training is untouched."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 3))


def _per_sample_ce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def _data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _reference(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    return reference_per_sample_gradients(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y))


def test_accumulated_micro_batches_store_own_gradients_and_leave_grad_as_plain_training(tmp_path: Path) -> None:
    model = _model().eval()  # dropout off: the reference and capture see the same function
    x, y = _data(8, 1)
    ids = torch.tensor([40, 3, 17, 8, 25, 11, 2, 30])
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        for k, rows in enumerate((slice(0, 4), slice(4, 8))):  # 2 micro-batches, loss divided by 2
            capture_step(
                model,
                lambda r=rows: model(x[r]),
                y[rows],
                ids[rows],
                _per_sample_ce,
                writer,
                step=0,
                micro_batch=k,
                lr=0.5,
                loss_scale=0.5,
            )
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # plain training: mean over all 8 samples
    assert max_relative_error(accumulated, {n: p.grad for n, p in model.named_parameters()}) <= 1e-5
    store = open_store(tmp_path)
    assert store.sample_ids("train").tolist() == ids.tolist()
    reference = _reference(model, x, y)
    for i, sid in enumerate(ids.tolist()):
        restored = store.restore(sid, capture_point="train", step=0)
        assert max_relative_error(restored, {n: g[i] for n, g in reference.items()}) <= 1e-5, sid
    meta = store.metadata("train")
    expected_losses = _per_sample_ce(model(x), y).detach().numpy()
    assert abs(meta["loss"] - expected_losses).max() <= 1e-5
    assert (meta["micro_batch"] == [0] * 4 + [1] * 4).all()
    assert (meta["lr"] == 0.5).all()


def test_checkpoint_pass_changes_neither_weights_nor_grad_nor_mode(tmp_path: Path) -> None:
    model = _model().train()
    x, y = _data(6, 2)
    F.cross_entropy(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = [
        (torch.arange(3) + 100, lambda: model(x[:3]), y[:3]),
        (torch.arange(3) + 103, lambda: model(x[3:]), y[3:]),
    ]
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        checkpoint_pass(model, batches, _per_sample_ce, writer, capture_point="epoch-0/val", step=7)
    assert model.training
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name]) and torch.equal(param.detach(), weights[name]), name
    store = open_store(tmp_path)
    assert store.capture_points() == ["epoch-0/val"] and store.steps() == [7]
    reference = _reference(model.eval(), x, y)  # the pass ran in eval mode (dropout off)
    for i in range(6):
        assert max_relative_error(store.restore(100 + i), {n: g[i] for n, g in reference.items()}) <= 1e-5, i
