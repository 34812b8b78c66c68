"""``nn.Linear`` and transformers' ``Conv1D``: ``grad W_i = sum_t D_i[t]^T A_i[t]``."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from metastore_plugins.core.capture.build import outer_record
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture
from metastore_plugins.core.records import LayerRecord, WeightLayout


def part_name(layer: str, part: str) -> str:
    """The record name of part of module ``layer``: ``"<layer>.<part>"`` (``"<part>"`` for the root)."""
    return f"{layer}.{part}" if layer else part


def linear_records(
    layer: str,
    inputs: Tensor,
    grad_output: Tensor,
    params: dict[str, str],
    param_shapes: dict[str, tuple[int, ...]],
    layout: WeightLayout = "out_in",
    pack: bool = True,
) -> list[LayerRecord]:
    """Factors of ``y = x W^T + b`` for inputs ``(B, ..., d_in)`` and output grads ``(B, ..., d_out)``.

    ``pack``: drop zero rows (:func:`~metastore_plugins.core.capture.build.outer_record`).
    """
    batch = inputs.shape[0]
    prefix = inputs.reshape(batch, -1, 1, inputs.shape[-1])  # (B, T, 1, d_in)
    suffix = grad_output.reshape(batch, -1, 1, grad_output.shape[-1])  # (B, T, 1, d_out)
    return [outer_record(layer, prefix, suffix, params, param_shapes, layout, pack=pack)]


def _shapes(module: nn.Module, params: dict[str, str]) -> dict[str, tuple[int, ...]]:
    return {role: tuple(getattr(module, role).shape) for role in params}


@register_capture(nn.Linear)
def capture_linear(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.Linear`` (any number of leading dimensions)."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ..., d_in)
    params = ctx.param_names(module)
    pack = ctx.pack_rows
    ctx.on_output_grad(
        output, lambda grad: linear_records(ctx.name, x, grad, params, _shapes(module, params), pack=pack)
    )


@register_capture("transformers.pytorch_utils.Conv1D")
def capture_conv1d_transposed(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for transformers' ``Conv1D`` (GPT-2), whose weight is ``(d_in, d_out)``."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ..., d_in)
    params = ctx.param_names(module)
    ctx.on_output_grad(
        output,
        lambda grad: linear_records(
            ctx.name, x, grad, params, _shapes(module, params), layout="in_out", pack=ctx.pack_rows
        ),
    )
