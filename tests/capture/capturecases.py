"""Shared checks for capture tests: compare a CaptureSession against the torch.func reference."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.testing import (
    autocast_reference_per_sample_gradients,
    max_relative_error,
    reference_per_sample_gradients,
)

TOLERANCE = 1e-5

Reference = Callable[[nn.Module, Callable[[nn.Module, Any], Tensor], Any], dict[str, Tensor]]


def captured_and_reference(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batch: Any,
    loss_reduction: str = "mean",
    reference: Reference = reference_per_sample_gradients,
    **session_kwargs: Any,
) -> tuple[dict[str, Tensor], dict[str, Tensor], CaptureSession]:
    """Per-sample gradients from capture and from the reference, plus the (closed) session.

    ``loss_fn`` returns the *mean* of per-sample losses; with ``loss_reduction="sum"``
    the captured run back-propagates ``B * loss`` so that the sum convention is exercised.
    """
    expected = reference(model, loss_fn, batch)
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
    reference: Reference = reference_per_sample_gradients,
    **session_kwargs: Any,
) -> CaptureSession:
    """Capture is exact (rel. err <= 1e-5) and covers every trainable parameter."""
    actual, expected, session = captured_and_reference(
        model, loss_fn, batch, loss_reduction, reference, **session_kwargs
    )
    assert session.uncaptured_parameters() == []
    assert max_model_relative_error(actual, expected) <= TOLERANCE
    return session


def assert_exact_under_autocast(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: Any, dtype: torch.dtype
) -> CaptureSession:
    """Under CPU autocast in ``dtype``: within ``4u`` of each sample's largest entry (plus 1e-5 of the batch's)
    of per-sample autograd through the same autocast forward (``docs/capture.md``, Mixed precision)."""
    expected = autocast_reference_per_sample_gradients(model, loss_fn, batch, dtype)
    with CaptureSession(model) as session:
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, batch)
        loss.backward()
    assert session.uncaptured_parameters() == []
    actual = session.per_sample_gradients()
    assert set(actual) == set(expected)
    bound = 4 * torch.finfo(dtype).eps / 2
    for name, want in expected.items():
        error = (actual[name].double() - want.double()).abs().flatten(1).amax(1)  # (B,)
        scale = want.double().abs().flatten(1).amax(1)  # (B,)
        assert (error <= bound * scale + 1e-5 * scale.max()).all(), (name, (error / scale).max().item())
    return session


def max_model_relative_error(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """:func:`max_relative_error`, where a gradient that is zero up to rounding is compared to the model's.

    Some parameters have an exactly zero gradient in exact arithmetic (attention key biases: softmax
    ignores a shift shared by all keys), leaving ~1e-14 rounding noise that no relative test can match.
    Each parameter's scale is at least 1e-6 of the largest gradient of the model.
    """
    if set(actual) != set(expected):
        return max_relative_error(actual, expected)  # raises, naming the differences
    floor = 1e-6 * max(e.abs().max().item() for e in expected.values())
    small = {name for name, e in expected.items() if e.abs().max().item() < floor}
    worst = max_relative_error(
        {n: a for n, a in actual.items() if n not in small}, {n: e for n, e in expected.items() if n not in small}
    )
    for name in small:
        worst = max(worst, (actual[name].to(expected[name].dtype) - expected[name]).abs().max().item() / floor)
    return worst


def reference_per_sample_gradients_loop(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: Any
) -> dict[str, Tensor]:
    """Independent reference for models ``torch.func.vmap`` cannot run (data-dependent control flow).

    One ordinary backward pass per sample, on that sample's own loss (a batch of one).
    """
    reference = copy.deepcopy(model)
    params = {name: p for name, p in reference.named_parameters() if p.requires_grad}
    batch_size = _leaves(batch)[0].shape[0]
    per_sample: list[tuple[Tensor, ...]] = []
    for i in range(batch_size):
        sample = tree_map(lambda t, i=i: t[i : i + 1] if isinstance(t, Tensor) else t, batch)
        per_sample.append(torch.autograd.grad(loss_fn(reference, sample), list(params.values()), allow_unused=True))
    return {
        name: torch.stack([g[k] if g[k] is not None else torch.zeros_like(p) for g in per_sample])
        for k, (name, p) in enumerate(params.items())
    }


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
