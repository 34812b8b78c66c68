"""Shared checks for capture tests: compare a CaptureSession against the torch.func reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients

TOLERANCE = 1e-5


def captured_and_reference(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batch: Any,
    loss_reduction: str = "mean",
    **session_kwargs: Any,
) -> tuple[dict[str, Tensor], dict[str, Tensor], CaptureSession]:
    """Per-sample gradients from capture and from the reference, plus the (closed) session.

    ``loss_fn`` returns the *mean* of per-sample losses; with ``loss_reduction="sum"``
    the captured run back-propagates ``B * loss`` so that the sum convention is exercised.
    """
    expected = reference_per_sample_gradients(model, loss_fn, batch)
    batch_size = next(t for t in _leaves(batch)).shape[0]
    with CaptureSession(model, loss_reduction=loss_reduction, **session_kwargs) as session:
        loss = loss_fn(model, batch)
        (loss * batch_size if loss_reduction == "sum" else loss).backward()
        actual = session.per_sample_gradients()
    return actual, expected, session


def assert_exact(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batch: Any,
    loss_reduction: str = "mean",
    **session_kwargs: Any,
) -> CaptureSession:
    """Capture is exact (rel. err <= 1e-5) and covers every trainable parameter."""
    actual, expected, session = captured_and_reference(model, loss_fn, batch, loss_reduction, **session_kwargs)
    assert session.uncaptured_parameters() == []
    assert max_relative_error(actual, expected) <= TOLERANCE
    return session


def _leaves(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [leaf for value in values for leaf in _leaves(value)]


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y`` (any leading dims are flattened)."""
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def squared_error(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean over samples of the summed squared error."""
    x, y = batch
    out = model(x)
    return (out - y).pow(2).reshape(out.shape[0], -1).sum(1).mean()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
