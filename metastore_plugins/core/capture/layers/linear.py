"""``nn.Linear`` and transformers' ``Conv1D``: ``grad W_i = sum_t D_i[t]^T A_i[t]``."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from metastore_plugins.core.capture.build import outer_record
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture
from metastore_plugins.core.records import LayerRecord, RecordHead, WeightLayout


def part_name(layer: str, part: str) -> str:
    """The record name of part of module ``layer``: ``"<layer>.<part>"`` (``"<part>"`` for the root)."""
    return f"{layer}.{part}" if layer else part


def linear_records(head: RecordHead, inputs: Tensor, grad_output: Tensor, pack: bool = True) -> list[LayerRecord]:
    """Factors of ``y = x W^T + b`` for inputs ``(B, ..., d_in)`` and output grads ``(B, ..., d_out)``.

    ``pack``: drop zero rows (:func:`~metastore_plugins.core.capture.build.outer_record`).
    """
    batch = inputs.shape[0]
    prefix = inputs.reshape(batch, -1, 1, inputs.shape[-1])  # (B, T, 1, d_in)
    suffix = grad_output.reshape(batch, -1, 1, grad_output.shape[-1])  # (B, T, 1, d_out)
    return [outer_record(head.layer, prefix, suffix, head.params, head.param_shapes, head.layout, pack=pack)]


def module_head(module: nn.Module, layer: str, params: dict[str, str], layout: WeightLayout = "out_in") -> RecordHead:
    """The head of records of ``module``'s parameters ``params`` (role -> name), their shapes read from the module."""
    return RecordHead(layer, params, {role: tuple(getattr(module, role).shape) for role in params}, layout)


@register_capture(nn.Linear)
def capture_linear(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.Linear`` (any number of leading dimensions)."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ..., d_in)
    params = ctx.param_names(module)
    pack = ctx.pack_rows
    ctx.on_output_grad(output, lambda grad: linear_records(module_head(module, ctx.name, params), x, grad, pack=pack))


@register_capture("transformers.pytorch_utils.Conv1D")
def capture_conv1d_transposed(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for transformers' ``Conv1D`` (GPT-2), whose weight is ``(d_in, d_out)``."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ..., d_in)
    params = ctx.param_names(module)
    ctx.on_output_grad(
        output,
        lambda grad: linear_records(module_head(module, ctx.name, params, "in_out"), x, grad, pack=ctx.pack_rows),
    )
