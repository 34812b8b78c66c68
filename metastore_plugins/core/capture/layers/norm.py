"""Norm layers and other small parameters: dense per-sample gradients (they are tiny).

``nn.LayerNorm``: with ``x_hat`` the normalized input and ``D`` the output gradient,
``grad gamma_i = sum_t D_i[t] * x_hat_i[t]`` and ``grad beta_i = sum_t D_i[t]``.

``BatchNorm`` with batch statistics (training mode): ``y_i = gamma x_hat_i + beta`` with
``x_hat = (x - mean_B) / sqrt(var_B + eps)`` (the batch's mean and biased variance over the batch
and spatial positions), held as computed on the batch, so ``grad gamma_i = sum_s D_i[:, s] * x_hat_i[:, s]``
and ``grad beta_i = sum_s D_i[:, s]`` are each sample's own-loss gradients. The layers *below* it are
not per sample (:mod:`~metastore_plugins.core.capture.batch_mixing`).

In eval mode the same formulas hold with the running statistics.

Other modules whose output for a sample depends only on that sample's input
(``GroupNorm``, ``RMSNorm``, ``InstanceNorm``) use
:func:`capture_with_vmap`, the generic rule of :mod:`.generic`: the vector-Jacobian
product of the module's own parameters, one sample at a time under ``torch.func.vmap``.
Modules without a rule go through it anyway; registering it for your own such modules,
``register_capture(MyModule, params=(...))(capture_with_vmap)``, marks them as known.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture.batch_mixing import BATCH_MIXED_FIX, uses_batch_statistics
from metastore_plugins.core.capture.build import as_computed
from metastore_plugins.core.capture.layers.generic import capture_generic
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture
from metastore_plugins.core.process_group import world_size
from metastore_plugins.core.records import LayerRecord, dense_record


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
    """
    capture_generic(module, args, kwargs, output, ctx)


def batch_norm_records(
    layer: str,
    x: Tensor,
    grad_output: Tensor,
    eps: float,
    params: dict[str, str],
    running: tuple[Tensor, Tensor] | None = None,
) -> list[LayerRecord]:
    """Dense per-sample gradients of a BatchNorm's weight and bias, its statistics held as computed.

    ``x``, ``grad_output``: the input and the output gradient, ``(B, C, *spatial)``. ``running``: the
    running mean and variance ``(C,)`` it normalized with (eval mode); None: the batch's own.
    """
    grad = as_computed(grad_output, grad_output.dtype)  # (B, C, *S) fp32
    x = as_computed(x, grad_output.dtype)  # (B, C, *S) fp32
    dims = [0, *range(2, x.dim())]
    if running is None:
        mean = x.mean(dims, keepdim=True)  # (1, C, 1, ...)
        var = x.var(dims, unbiased=False, keepdim=True)  # (1, C, 1, ...): the biased variance F.batch_norm uses
    else:
        shape = (1, -1, *([1] * (x.dim() - 2)))
        mean, var = (stat.float().reshape(shape) for stat in running)  # (1, C, 1, ...) each
    x_hat = (x - mean) * torch.rsqrt(var + eps)  # (B, C, *S)
    batch, channels = x.shape[:2]
    grads: dict[str, Tensor] = {}
    if "weight" in params:
        grads["weight"] = (grad * x_hat).reshape(batch, channels, -1).sum(2)  # (B, C)
    if "bias" in params:
        grads["bias"] = grad.reshape(batch, channels, -1).sum(2)  # (B, C)
    return [dense_record(layer, grads, params)]


def _synchronized(module: nn.Module) -> bool:
    """Whether a ``SyncBatchNorm`` takes its statistics over the batches of several processes."""
    return isinstance(module, nn.SyncBatchNorm) and world_size(module.process_group) > 1


def capture_batch_norm(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for BatchNorms: :func:`batch_norm_records` with the batch's or the running statistics."""
    batch_statistics = uses_batch_statistics(module)
    if batch_statistics and _synchronized(module):
        ctx.unsupported(
            f"'{ctx.name}' (SyncBatchNorm) normalizes with the statistics of every process's batch, which one "
            "process cannot recompute: its weight and bias are not captured in training mode. To fix: "
            f"{BATCH_MIXED_FIX}; or pass unsupported='skip' to accept it."
        )
        return
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, C, *S)
    params, eps = ctx.param_names(module), float(module.eps)  # type: ignore[arg-type]
    running = None
    if not batch_statistics:  # eval mode: each sample by itself (copied: a later training forward updates them)
        running = (module.get_buffer("running_mean").clone(), module.get_buffer("running_var").clone())  # (C,) each
    ctx.on_output_grad(output, lambda grad: batch_norm_records(ctx.name, x, grad, eps, params, running))


_PER_SAMPLE_NORMS: tuple[type[nn.Module], ...] = (
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    *(nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d),
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
register_capture(*_PER_SAMPLE_NORMS)(capture_with_vmap)
_BATCH_NORMS: tuple[type[nn.Module], ...] = (
    *(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
    *(nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d),
)
register_capture(*_BATCH_NORMS)(capture_batch_norm)
