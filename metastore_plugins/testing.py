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

Under mixed precision, :func:`autocast_reference_per_sample_gradients` differentiates the
very autocast forward a capture sees, with plain autograd (see ``docs/capture.md``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from metastore_plugins.core.errors import ReferenceMismatchError
from metastore_plugins.core.model.losses import LossFn


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


def autocast_reference_per_sample_gradients(
    model: nn.Module, loss_fn: LossFn, batch: Any, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """Parameter name -> ``(B, *shape)`` by plain autograd through one autocast forward of the whole batch.

    The reference under mixed precision. :func:`reference_per_sample_gradients` runs batches of
    one, whose low-precision forward rounds differently from the batched one; this differentiates
    the forward a capture sees. It runs ``loss_fn(model, batch)`` once under
    ``torch.autocast(device, dtype=dtype)`` (no autocast when ``dtype`` is None), takes the
    gradient ``G`` of the loss with respect to the model's output and back-propagates each
    sample's row of ``G`` alone, times ``B``. Autograd rounds each weight gradient of an autocast
    matmul to ``dtype`` once, as the autocast backward does for ``.grad``.

    Args:
        model: a model whose output (or its ``.logits``) has samples along dim 0 and whose
            layers do not mix samples.
        loss_fn: ``loss_fn(model, batch) -> scalar``, the mean over samples of per-sample
            losses; it calls ``model`` once.
        batch: a tensor or a pytree of tensors with samples along dim 0.
        dtype: autocast's dtype (``torch.bfloat16``, ``torch.float16``) on the parameters' device.
    """
    model = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    outputs: list[Any] = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output))
    device = next(iter(params.values())).device.type
    try:
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, batch)
    finally:
        handle.remove()
    output = getattr(outputs[0], "logits", outputs[0])  # (B, ...)
    (grad_output,) = torch.autograd.grad(loss, output, retain_graph=True)  # (B, ...), in the output's dtype
    batch_size = output.shape[0]
    per_sample: list[list[Tensor]] = []
    for i in range(batch_size):
        row = torch.zeros_like(grad_output)
        row[i] = grad_output[i]
        grads = torch.autograd.grad(output, list(params.values()), row, retain_graph=True, allow_unused=True)
        per_sample.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())])
    return {name: torch.stack([g[k] for g in per_sample]) * batch_size for k, name in enumerate(params)}


def max_relative_error(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> float:
    """Largest ``max|a - e| / max|e|`` over parameters; raises if the names differ."""
    if set(actual) != set(expected):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        raise ReferenceMismatchError(f"parameter names differ: missing {missing}, unexpected {extra}")
    worst = 0.0
    for name, exp in expected.items():
        act = actual[name].to(exp.dtype)
        if act.shape != exp.shape:
            raise ReferenceMismatchError(f"{name}: shape {tuple(act.shape)} != expected {tuple(exp.shape)}")
        scale = exp.abs().max().clamp_min(torch.finfo(exp.dtype).tiny)
        worst = max(worst, ((act - exp).abs().max() / scale).item())
    return worst
