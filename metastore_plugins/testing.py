"""A slow but obviously correct reference for per-sample gradients, to check capture rules.

It knows nothing of factors: it differentiates each sample's own loss with
``torch.func`` (``functional_call`` + ``vmap(grad)``). Use it to test a rule you
registered for your own layer::

    from metastore_plugins.testing import reference_per_sample_gradients, max_relative_error

    def loss_fn(model, batch):                     # batch: samples along dim 0
        return F.cross_entropy(model(batch["x"]), batch["y"])

    expected = reference_per_sample_gradients(model, loss_fn, batch)
    with CaptureSession(model) as session:
        loss_fn(model, batch).backward()
        assert max_relative_error(session.per_sample_gradients(), expected) < 1e-5
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

LossFn = Callable[[nn.Module, Any], Tensor]


class _LossModule(nn.Module):
    """Wraps ``loss_fn(model, batch)`` so that ``functional_call`` can swap the model's parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Tensor:
        return self.loss_fn(self.model, batch)


def reference_per_sample_gradients(
    model: nn.Module, loss_fn: LossFn, batch: Any, chunk_size: int | None = None
) -> dict[str, Tensor]:
    """Parameter name -> ``(B, *shape)``: the gradient of each sample's own loss.

    Args:
        model: the model; only parameters with ``requires_grad`` are differentiated.
        loss_fn: ``loss_fn(model, batch) -> scalar``; called on batches of one sample.
        batch: a tensor or a pytree (dict, tuple) of tensors with samples along dim 0.
        chunk_size: samples per vmap chunk, to bound memory.
    """
    wrapper = _LossModule(copy.deepcopy(model), loss_fn)  # functional_call can leave tied modules altered
    params = {n: p.detach() for n, p in wrapper.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in wrapper.named_buffers()}

    def sample_loss(parameters: dict[str, Tensor], sample: Any) -> Tensor:
        batch_of_one = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, sample)
        return functional_call(wrapper, (parameters, buffers), (batch_of_one,))

    grads = vmap(grad(sample_loss), in_dims=(None, 0), chunk_size=chunk_size)(params, batch)
    return {name.removeprefix("model."): g for name, g in grads.items()}


def max_relative_error(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> float:
    """Largest ``max|a - e| / max|e|`` over parameters; raises if the names differ."""
    if set(actual) != set(expected):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        raise AssertionError(f"parameter names differ: missing {missing}, unexpected {extra}")
    worst = 0.0
    for name, exp in expected.items():
        act = actual[name].to(exp.dtype)
        if act.shape != exp.shape:
            raise AssertionError(f"{name}: shape {tuple(act.shape)} != expected {tuple(exp.shape)}")
        scale = exp.abs().max().clamp_min(torch.finfo(exp.dtype).tiny)
        worst = max(worst, ((act - exp).abs().max() / scale).item())
    return worst
