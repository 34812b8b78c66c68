"""A LightningModule whose forward runs under ``torch.utils.checkpoint`` (non-reentrant): the layers run
again inside ``backward``, and the callback still stores each sample's own gradient (against torch.func)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

pytest.importorskip("lightning")
from lightning_cases import Classifier, fit, loaders, make_data  # noqa: E402

from metastore_plugins import MetaStoreCallback, open_store  # noqa: E402

N_TRAIN = 16


class _Checkpointed(Classifier):
    """The network under activation checkpointing while training; counts the first layer's forward calls."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)  # the weights the reference uses stay those of every step
        self.training_calls = 0
        self.net[0].register_forward_hook(self._count)

    def _count(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.training_calls += int(module.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.net, x, use_reentrant=False) if self.training else self.net(x)


def test_each_samples_own_gradient_under_activation_checkpointing(tmp_path: Path) -> None:
    train, val = loaders(N_TRAIN, 4, 8)
    module = _Checkpointed()
    callback = MetaStoreCallback(tmp_path / "store", encoding="fp32", reports=False, checkpoint_every_n_epochs=0)
    trainer = fit(tmp_path, module, train, val, [callback], max_epochs=1)
    assert module.training_calls == 2 * trainer.global_step  # each step's forward ran again in backward
    data = make_data(N_TRAIN, 1)
    weights = {name: p.detach() for name, p in module.net.named_parameters()}

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(module.net, params, (x[None],)), y[None])

    expected = vmap(grad(loss), in_dims=(None, 0, 0))(weights, *data.tensors)  # name -> (N, *shape)
    store = open_store(tmp_path / "store")
    for sid in range(N_TRAIN):
        stored = store.restore(sid, capture_point="train")
        assert set(stored) == {f"net.{name}" for name in weights}
        for name, value in stored.items():
            reference = expected[name.removeprefix("net.")][sid]
            assert float((value - reference).abs().max()) <= 1e-5 * float(reference.abs().max()) + 1e-7, name
