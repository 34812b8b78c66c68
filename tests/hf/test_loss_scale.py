"""The loss scale measured in backward: each sample's own gradient whatever the trainer multiplied the loss by."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.errors import LossScaleError
from metastore_plugins.core.training.loss_scale import MeasuredLossScale, per_sample_weight
from metastore_plugins.testing import reference_per_sample_gradients


def test_per_sample_weight_tells_the_reduction() -> None:
    losses = torch.tensor([0.5, 1.0, 2.0, 0.25])
    assert per_sample_weight(losses.mean(), losses) == pytest.approx(1 / 4)
    assert per_sample_weight(losses.sum() / 10, losses, num_items=torch.tensor(10)) == pytest.approx(1 / 10)
    assert per_sample_weight(losses.sum(), losses) == pytest.approx(1.0)
    with pytest.raises(LossScaleError, match="per_sample_loss"):
        per_sample_weight(losses.max(), losses)


def test_unmeasured_scale_names_the_cause() -> None:
    with pytest.raises(LossScaleError, match="compute_loss_func"):
        MeasuredLossScale().get_scale()


@pytest.mark.parametrize("mode", ["mean / 3", "sum / 10 items", "mean * 1024 (fp16 scaler)"])
def test_factors_are_each_samples_own_gradient(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    scale = MeasuredLossScale()
    with CaptureSession(model, loss_reduction="mean", grad_scaler=scale) as session:
        losses = F.cross_entropy(model(x), y, reduction="none")
        num_items = 10 if mode.startswith("sum") else None
        loss = losses.sum() / num_items if num_items else losses.mean()
        scale.watch(loss, per_sample_weight(loss.detach(), losses, num_items), len(losses))
        factor = {"mean / 3": 1 / 3, "sum / 10 items": 1.0, "mean * 1024 (fp16 scaler)": 1024.0}[mode]
        (loss * factor).backward()
        grads = session.per_sample_gradients()
    expected = reference_per_sample_gradients(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y))
    for name, value in expected.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-6)
