"""``nn.Conv1d`` / ``nn.Conv2d`` via unfold: a convolution is a Linear layer over patches.

With ``U_i = unfold(x_i)`` of shape ``(L, C_in/G * k)`` per group and ``D_i`` the output
gradient ``(L, C_out/G)`` per group, ``grad W_i[g] = D_i[g]^T U_i[g]`` (reshaped to
``(C_out, C_in/G, *kernel)``) and ``grad b_i = sum_l D_i[l]``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture.records import LayerRecord, outer_record
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture


def _explicit_padding(conv: nn.Conv1d | nn.Conv2d) -> list[int]:
    """``F.pad`` amounts (last dimension first) equivalent to the module's padding."""
    pads: list[int] = []
    for dim in reversed(range(len(conv.kernel_size))):
        if conv.padding == "same":
            total = conv.dilation[dim] * (conv.kernel_size[dim] - 1)
            pads += [total // 2, total - total // 2]
        elif conv.padding == "valid":
            pads += [0, 0]
        else:
            pads += [conv.padding[dim]] * 2  # type: ignore[index]
    return pads


def unfold_patches(conv: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """Input patches ``(B, L, C_in * prod(kernel))`` for input ``(B, C_in, *spatial)``."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, _explicit_padding(conv), mode=mode)
    if len(conv.kernel_size) == 1:  # treat (B, C, W) as (B, C, 1, W)
        padded = padded.unsqueeze(2)
        kernel, dilation, stride = (1, *conv.kernel_size), (1, *conv.dilation), (1, *conv.stride)
    else:
        kernel, dilation, stride = conv.kernel_size, conv.dilation, conv.stride
    patches = F.unfold(padded, kernel, dilation=dilation, stride=stride)  # (B, C_in * k, L)
    return patches.transpose(1, 2)  # (B, L, C_in * k)


def conv_records(
    conv: nn.Conv1d | nn.Conv2d, layer: str, x: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """Factors of a convolution for input ``(B, C_in, *spatial)`` and output grad ``(B, C_out, *spatial_out)``."""
    batch, groups = x.shape[0], conv.groups
    patches = unfold_patches(conv, x)  # (B, L, C_in * k)
    prefix = patches.reshape(batch, patches.shape[1], groups, -1)  # (B, L, G, C_in/G * k)
    suffix = grad_output.reshape(batch, conv.out_channels, -1).transpose(1, 2)  # (B, L, C_out)
    suffix = suffix.reshape(batch, -1, groups, conv.out_channels // groups)  # (B, L, G, C_out/G)
    shapes = {role: tuple(getattr(conv, role).shape) for role in params}
    return [outer_record(layer, prefix, suffix, params, shapes)]


@register_capture(nn.Conv1d, nn.Conv2d)
def capture_conv(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext) -> None:
    """Hook body for ``nn.Conv1d`` and ``nn.Conv2d`` (stride, padding, dilation, groups, padding modes)."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, C_in, *spatial)
    params = ctx.param_names(module)
    ctx.on_output_grad(output, lambda grad: conv_records(module, ctx.name, x, grad, params))  # type: ignore[arg-type]
