"""A training_step whose reduction disagrees with loss_reduction= stops at the first step instead of storing
gradients B times too large or too small; matching settings store each sample's own gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning_cases import Classifier, fit, loaders
from torch import Tensor

from metastore_plugins import MetaStoreCallback, open_store


class SumClassifier(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="sum")


class SmoothedClassifier(Classifier):
    """A loss that is no mean or sum of the default per-sample losses: it cannot be checked."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y, label_smoothing=0.3)


def test_a_sum_loss_with_the_default_mean_setting_is_refused(tmp_path: Path) -> None:
    train, val = loaders()
    callback = MetaStoreCallback(tmp_path / "store", checkpoint_every_n_epochs=0, reports=False)
    with pytest.raises(ValueError, match=r"is the sum of the batch's 8 .*8x too large.*loss_reduction='sum'"):
        fit(tmp_path, SumClassifier(), train, val, [callback], max_epochs=1)
    assert not list((tmp_path / "store").glob("*.safetensors"))  # nothing mis-scaled was stored


@pytest.mark.parametrize("module, reduction", [(SumClassifier, "sum"), (Classifier, "mean")])
def test_matching_settings_store_each_samples_own_gradient(tmp_path: Path, module: type, reduction: str) -> None:
    train, val = loaders()
    callback = MetaStoreCallback(
        tmp_path / "store", loss_reduction=reduction, checkpoint_every_n_epochs=0, reports=False
    )
    model = module()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    fit(tmp_path, model, train, val, [callback], max_epochs=1, limit_train_batches=1)
    store = open_store(tmp_path / "store")
    ids = store.sample_ids("train")
    assert len(ids) == 8
    x, y = train.dataset.dataset.tensors  # IndexedDataset over the TensorDataset
    reference = Classifier()
    reference.load_state_dict(start)
    for sample in ids.tolist():
        reference.zero_grad()
        F.cross_entropy(reference(x[sample : sample + 1]), y[sample : sample + 1]).backward()
        stored = store.restore(sample, capture_point="train", step=0)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(stored[name].float(), param.grad, rtol=2e-3, atol=2e-4)  # fp16 encoding


def test_an_uncheckable_loss_is_said_once_and_training_goes_on(tmp_path: Path) -> None:
    train, val = loaders()
    callback = MetaStoreCallback(tmp_path / "store", checkpoint_every_n_epochs=0, reports=False)
    with pytest.warns(UserWarning, match="the loss reduction cannot be checked") as caught:
        fit(tmp_path, SmoothedClassifier(), train, val, [callback], max_epochs=1)
    assert sum("cannot be checked" in str(w.message) for w in caught) == 1
    assert len(open_store(tmp_path / "store").steps("train")) == 5
