"""Norm layers and other small parameters: dense per-sample gradients (they are tiny).

``nn.LayerNorm``: with ``x_hat`` the normalized input and ``D`` the output gradient,
``grad gamma_i = sum_t D_i[t] * x_hat_i[t]`` and ``grad beta_i = sum_t D_i[t]``.

Other modules whose output for a sample depends only on that sample's input
(``GroupNorm``, ``RMSNorm``, ``InstanceNorm``, ``BatchNorm`` in eval mode) use
:func:`capture_with_vmap`, the generic rule of :mod:`.generic`: the vector-Jacobian
product of the module's own parameters, one sample at a time under ``torch.func.vmap``.
Modules without a rule go through it anyway; registering it for your own such modules,
``register_capture(MyModule, params=(...))(capture_with_vmap)``, marks them as known.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture.layers.generic import capture_generic
from metastore_plugins.core.capture.records import LayerRecord, as_computed, dense_record
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture


def layer_norm_records(
    norm: nn.LayerNorm, layer: str, x: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """Dense per-sample gradients of a LayerNorm for input and output grad ``(B, ..., *normalized_shape)``."""
    batch = x.shape[0]
    grad = as_computed(grad_output, grad_output.dtype)  # (B, ..., *shape) fp32
    x_hat = F.layer_norm(as_computed(x, grad_output.dtype), norm.normalized_shape, eps=norm.eps)  # fp32
    grads: dict[str, Tensor] = {}
    if "weight" in params:
        grads["weight"] = (grad * x_hat).reshape(batch, -1, *norm.normalized_shape).sum(1)  # (B, *shape)
    if "bias" in params:
        grads["bias"] = grad.reshape(batch, -1, *norm.normalized_shape).sum(1)  # (B, *shape)
    return [dense_record(layer, grads, params)]


@register_capture(nn.LayerNorm)
def capture_layer_norm(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.LayerNorm``."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ..., *normalized_shape)
    params = ctx.param_names(module)
    ctx.on_output_grad(output, lambda grad: layer_norm_records(module, ctx.name, x, grad, params))  # type: ignore[arg-type]


def capture_with_vmap(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for modules whose output for a sample depends only on that sample's input: the
    generic rule (:func:`~metastore_plugins.core.capture.layers.generic.capture_generic`), registered.

    ``BatchNorm`` in training mode normalizes with batch statistics, which mix samples: reported.
    """
    capture_generic(module, args, kwargs, output, ctx)


_PER_SAMPLE_NORMS: tuple[type[nn.Module], ...] = (
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.InstanceNorm3d,
    nn.BatchNorm3d,
    *(nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d),
    *(nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d),
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
register_capture(*_PER_SAMPLE_NORMS)(capture_with_vmap)
