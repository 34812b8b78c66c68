"""Norm layers and other small parameters: dense per-sample gradients (they are tiny).

``nn.LayerNorm``: with ``x_hat`` the normalized input and ``D`` the output gradient,
``grad gamma_i = sum_t D_i[t] * x_hat_i[t]`` and ``grad beta_i = sum_t D_i[t]``.

Other modules whose output for a sample depends only on that sample's input
(``GroupNorm``, ``RMSNorm``, ``InstanceNorm``, ``BatchNorm`` in eval mode) use
:func:`capture_with_vmap`: the vector-Jacobian product of the module's own
parameters, one sample at a time under ``torch.func.vmap``. Register it for your
own such modules with ``register_capture(MyModule, params=(...))(capture_with_vmap)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

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


def vmap_records(
    module: nn.Module, layer: str, x: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """Dense per-sample gradients of ``module``'s own parameters, one sample at a time.

    Exact for any module whose output for sample i depends only on input i. The module is
    re-run in fp32, with autocast off, on the input as it was read (:func:`as_computed`), so
    that mixed precision costs nothing beyond the rounding of the input and the output gradient.
    """
    computed_in = grad_output.dtype
    own = {local: as_computed(module.get_parameter(local).detach(), torch.float32) for local in params}
    state = {
        name: as_computed(tensor.detach(), torch.float32)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if name not in own and tensor.is_floating_point()
    }  # the rest of the module in fp32 too: frozen parameters, BatchNorm's running statistics

    def one_sample(x_i: Tensor, grad_i: Tensor) -> dict[str, Tensor]:
        pullback = vjp(lambda p: functional_call(module, {**state, **p}, (x_i.unsqueeze(0),), strict=False), own)[1]
        (grads,) = pullback(grad_i.unsqueeze(0))
        return grads

    inputs, grads_out = as_computed(x, computed_in), as_computed(grad_output, computed_in)  # fp32
    with torch.enable_grad(), torch.autocast(inputs.device.type, enabled=False):
        grads = vmap(one_sample)(inputs, grads_out)  # role -> (B, *shape)
    return [dense_record(layer, grads, params)]


def capture_with_vmap(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for per-sample-independent modules with small parameters."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        ctx.unsupported(
            f"'{ctx.name}' ({type(module).__name__}) normalizes with batch statistics in training mode, "
            "so one sample's gradient depends on the whole batch and per-sample gradients of its weight "
            "and bias are not defined. Use GroupNorm/LayerNorm, freeze it, or call module.eval()."
        )
        return
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ...)
    params = ctx.param_names(module)
    ctx.on_output_grad(output, lambda grad: vmap_records(module, ctx.name, x, grad, params))


_PER_SAMPLE_NORMS: tuple[type[nn.Module], ...] = (
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
register_capture(*_PER_SAMPLE_NORMS)(capture_with_vmap)
