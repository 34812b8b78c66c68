"""``nn.Conv1d`` / ``nn.Conv2d`` via unfold: a convolution is a Linear layer over patches.

With ``U_i = unfold(x_i)`` of shape ``(L, C_in/G * k)`` per group and ``D_i`` the output
gradient ``(L, C_out/G)`` per group, ``grad W_i[g] = D_i[g]^T U_i[g]`` (reshaped to
``(C_out, C_in/G, *kernel)``) and ``grad b_i = sum_l D_i[l]``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture.records import (
    LayerRecord,
    as_computed,
    dense_is_smaller,
    dense_record,
    nonzero_rows,
    outer_record,
)
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
            pads += [int(conv.padding[dim])] * 2
    return pads


def unfold_patches(conv: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """Input patches ``(B, C_in * prod(kernel), L)`` for input ``(B, C_in, *spatial)`` (``F.unfold``'s layout).

    Built as a strided view of the padded input, ``(B, C, k_h, k_w, H_out, W_out)``, copied
    once by ``reshape``: the same numbers as ``F.unfold``, about 10x faster on the CPU.
    """
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, _explicit_padding(conv), mode=mode)
    kernel: tuple[int, ...] = tuple(conv.kernel_size)
    dilation: tuple[int, ...] = tuple(conv.dilation)
    stride: tuple[int, ...] = tuple(conv.stride)
    if len(kernel) == 1:  # treat (B, C, W) as (B, C, 1, W)
        padded = padded.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
    batch, channels, height, width = padded.shape
    out_h = (height - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    out_w = (width - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    s_b, s_c, s_h, s_w = padded.stride()
    windows = padded.as_strided(
        (batch, channels, kernel[0], kernel[1], out_h, out_w),
        (s_b, s_c, dilation[0] * s_h, dilation[1] * s_w, stride[0] * s_h, stride[1] * s_w),
        padded.storage_offset(),
    )  # (B, C, k_h, k_w, H_out, W_out)
    return windows.reshape(batch, channels * kernel[0] * kernel[1], out_h * out_w)  # (B, C_in * k, L)


def estimated_kept_rows(grad: Tensor, probes: int = 8) -> int:
    """(sample, position) pairs of ``grad (B, C_out, L)`` with a gradient.

    Counted in the first ``probes`` samples and scaled to ``B``.

    It only chooses between the factored and the dense representation (both exact), so an
    estimate will do; counting every sample cost as much as a tenth of the capture.
    """
    probed = grad[:probes]  # (<= probes, C_out, L), contiguous
    return int(nonzero_rows(probed, dim=1).sum()) * grad.shape[0] // max(1, probed.shape[0])


def conv_records(
    conv: nn.Conv1d | nn.Conv2d, layer: str, x: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """Factors of a convolution for input ``(B, C_in, *spatial)`` and output grad ``(B, C_out, *spatial_out)``.

    When the dense per-sample gradients are smaller than the kept factor rows (small
    kernels over large images), they are computed directly, ``grad W_i[g] = D_i[g] U_i[g]^T``
    as one batched matmul over the channel-major layouts, without transposing the patches.
    Under autocast the input is rounded to the dtype the convolution ran in and both operands
    are upcast to fp32 first (:func:`~metastore_plugins.core.capture.records.as_computed`).
    """
    batch, groups = x.shape[0], conv.groups
    d_out = conv.out_channels // groups
    computed_in = grad_output.dtype
    grad = as_computed(grad_output, computed_in).reshape(batch, conv.out_channels, -1)  # (B, C_out, L) fp32
    patches = unfold_patches(conv, as_computed(x, computed_in))  # (B, C_in * k, L) fp32
    d_in = patches.shape[1] // groups
    shapes = {role: tuple(getattr(conv, role).shape) for role in params}
    kept = estimated_kept_rows(grad)
    if dense_is_smaller(kept, groups, d_in, d_out, batch, shapes):
        grads = {}
        if "weight" in params:
            per_group = grad.reshape(batch, groups, d_out, -1) @ patches.reshape(batch, groups, d_in, -1).transpose(
                2, 3
            )
            grads["weight"] = per_group.reshape(batch, *shapes["weight"])  # (B, G, d_out, d_in) -> (B, *weight)
        if "bias" in params:
            grads["bias"] = grad.sum(2)  # (B, C_out)
        return [dense_record(layer, grads, params)]
    prefix = patches.transpose(1, 2).reshape(batch, -1, groups, d_in)  # (B, L, G, C_in/G * k)
    suffix = grad.transpose(1, 2).reshape(batch, -1, groups, d_out)  # (B, L, G, C_out/G)
    return [outer_record(layer, prefix, suffix, params, shapes)]


@register_capture(nn.Conv1d, nn.Conv2d)
def capture_conv(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.Conv1d`` and ``nn.Conv2d`` (stride, padding, dilation, groups, padding modes)."""
    x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, C_in, *spatial)
    params = ctx.param_names(module)
    ctx.on_output_grad(output, lambda grad: conv_records(module, ctx.name, x, grad, params))  # type: ignore[arg-type]
