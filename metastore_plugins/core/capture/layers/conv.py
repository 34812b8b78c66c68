"""Convolutions via unfold: a convolution is a Linear layer over patches.

``nn.Conv1d/2d/3d``, ``y = conv(x, W) + b``, ``W`` ``(C_out, C_in/G, *k)``: with ``U_i = unfold(x_i)``
``(L, C_in/G * prod(k))`` per group (``L`` output positions) and ``D_i`` the output gradient
``(L, C_out/G)`` per group, ``grad W_i[g] = D_i[g]^T U_i[g]`` (reshaped to ``W``'s shape) and
``grad b_i = sum_l D_i[l]``.

``nn.ConvTranspose1d/2d/3d``, ``y = conv_transpose(x, W) + b``, ``W`` ``(C_in, C_out/G, *k)``: the
transposed convolution is the adjoint of the convolution ``u -> conv(u, W)`` from ``C_out`` to
``C_in`` channels (same stride, padding, dilation, groups), so for any ``g`` shaped like ``y``,
``<conv_transpose(x, W), g> = <x, conv(g, W)>``. With ``g = dL/dy`` the weight gradient is the
convolution's weight gradient with the roles of input and output gradient swapped::

    grad W_i[c_in, c_out, k] = sum_pos x_i[c_in, pos] * unfold(g_i)[(c_out, k), pos]

that is ``grad W_i[g] = X_i[g]^T U_i[g]`` with ``X_i`` the input ``(L_in, C_in/G)`` per group and
``U_i = unfold(g_i)`` ``(L_in, C_out/G * prod(k))``: the unfold of the output gradient by the
module's kernel, stride, padding and dilation has exactly one window per input position
(``output_padding`` only adds output positions that windows reach or, when it is at least the
stride, trailing windows that are dropped). ``grad b_i = sum_pos g_i[:, pos]`` ``(C_out,)``.

Both are stored as ``"outer"`` records of the module's path (``grad W = D^T A``, ``G`` groups), or
dense when that is smaller. For a transposed convolution ``D`` (the record's ``suffix``) is the
input ``x`` and ``A`` (``prefix``) the unfolded output gradient: the product, and so every
gradient, norm and scaling of the record, is the same bilinear form; the bias, which sums the
output gradient over output positions rather than rows, is a dense record ``<path>.bias``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture.build import as_computed, dense_is_smaller, nonzero_rows, outer_record
from metastore_plugins.core.capture.layers.linear import module_head, part_name
from metastore_plugins.core.capture.registry import ForwardFn, LayerContext, first_input, register_capture
from metastore_plugins.core.records import LayerRecord, RecordHead, dense_record

Conv = nn.modules.conv._ConvNd


def _explicit_padding(conv: Conv) -> list[int]:
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


def unfold_patches(conv: Conv, x: Tensor, positions: Sequence[int] | None = None) -> Tensor:
    """Input patches ``(B, C * prod(kernel), L)`` for ``x`` ``(B, C, *spatial)`` (``F.unfold``'s layout, any dims).

    Built as a strided view of the padded input, ``(B, C, *kernel, *out)``, copied once by
    ``reshape``: the same numbers as ``F.unfold``, about 10x faster on the CPU. ``positions``
    caps the number of windows per spatial dimension (trailing windows are dropped).
    """
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, _explicit_padding(conv), mode=mode)
    kernel, dilation, stride = tuple(conv.kernel_size), tuple(conv.dilation), tuple(conv.stride)
    out = [(size - d * (k - 1) - 1) // s + 1 for size, k, d, s in zip(padded.shape[2:], kernel, dilation, stride)]
    if positions is not None:
        out = [min(o, int(p)) for o, p in zip(out, positions)]
    batch, channels = padded.shape[:2]
    s_b, s_c, *s_x = padded.stride()
    windows = padded.as_strided(
        (batch, channels, *kernel, *out),
        (s_b, s_c, *(d * s for d, s in zip(dilation, s_x)), *(st * s for st, s in zip(stride, s_x))),
        padded.storage_offset(),
    )  # (B, C, *kernel, *out)
    return windows.reshape(batch, channels * math.prod(kernel), math.prod(out))  # (B, C * k, L)


def estimated_kept_rows(grad: Tensor, probes: int = 8) -> int:
    """(sample, position) pairs of ``grad (B, C, L)`` with a nonzero entry.

    Counted in the first ``probes`` samples and scaled to ``B``.

    It only chooses between the factored and the dense representation (both exact), so an
    estimate will do; counting every sample cost as much as a tenth of the capture.
    """
    probed = grad[:probes]  # (<= probes, C, L), contiguous
    return int(nonzero_rows(probed, dim=1).sum()) * grad.shape[0] // max(1, probed.shape[0])


def patch_records(head: RecordHead, rows: Tensor, patches: Tensor, groups: int) -> list[LayerRecord]:
    """``grad W_i[g] = D_i[g] A_i[g]^T`` (and ``grad b_i = sum_l D_i[l]``) for channel-major fp32 factors.

    Args:
        rows: ``D``, ``(B, G * d_out, L)``: the factor indexing the weight's first dimension.
        patches: ``A``, ``(B, G * d_in, L)``: unfolded patches, ``d_in = channels/G * prod(kernel)``.

    When the dense per-sample gradients are smaller than the kept factor rows (small kernels
    over large images), they are computed directly as one batched matmul over the channel-major
    layouts, without transposing the patches; else an ``"outer"`` record is built.
    """
    batch, params, shapes = rows.shape[0], head.params, head.param_shapes
    d_out, d_in = rows.shape[1] // groups, patches.shape[1] // groups
    if dense_is_smaller(estimated_kept_rows(rows), groups, d_in, d_out, batch, shapes):
        grads = {}
        if "weight" in params:
            per_group = rows.reshape(batch, groups, d_out, -1) @ patches.reshape(batch, groups, d_in, -1).transpose(
                2, 3
            )  # (B, G, d_out, d_in)
            grads["weight"] = per_group.reshape(batch, *shapes["weight"])
        if "bias" in params:
            grads["bias"] = rows.sum(2)  # (B, G * d_out)
        return [dense_record(head.layer, grads, params)]
    prefix = patches.transpose(1, 2).reshape(batch, -1, groups, d_in)  # (B, L, G, d_in)
    suffix = rows.transpose(1, 2).reshape(batch, -1, groups, d_out)  # (B, L, G, d_out)
    return [outer_record(head.layer, prefix, suffix, params, shapes)]


def conv_records(conv: Conv, layer: str, x: Tensor, grad_output: Tensor, params: dict[str, str]) -> list[LayerRecord]:
    """Records of a convolution for input ``(B, C_in, *spatial)`` and output grad ``(B, C_out, *spatial_out)``.

    Under autocast the input is rounded to the dtype the convolution ran in and both operands
    are upcast to fp32 first (:func:`~metastore_plugins.core.capture.build.as_computed`).
    """
    computed_in = grad_output.dtype
    grad = as_computed(grad_output, computed_in).reshape(x.shape[0], conv.out_channels, -1)  # (B, C_out, L) fp32
    patches = unfold_patches(conv, as_computed(x, computed_in))  # (B, C_in * k, L) fp32
    return patch_records(module_head(conv, layer, params), grad, patches, conv.groups)


def conv_transpose_records(
    conv: Conv, layer: str, x: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """Records of a transposed convolution for input ``(B, C_in, *spatial_in)`` and output grad ``(B, C_out, *out)``.

    The weight's record has ``D = x`` and ``A = unfold(grad)`` (see the module docstring); the
    bias, ``sum_pos grad``, is a dense record ``<layer>.bias``.
    """
    computed_in = grad_output.dtype
    batch = x.shape[0]
    grad = as_computed(grad_output, computed_in)  # (B, C_out, *out) fp32
    records = []
    if "weight" in params:
        inputs = as_computed(x, computed_in).reshape(batch, conv.in_channels, -1)  # (B, C_in, L_in) fp32
        patches = unfold_patches(conv, grad, positions=x.shape[2:])  # (B, C_out * k, L_in)
        records += patch_records(module_head(conv, layer, {"weight": params["weight"]}), inputs, patches, conv.groups)
    if "bias" in params:
        bias = grad.reshape(batch, conv.out_channels, -1).sum(2)  # (B, C_out)
        records.append(dense_record(part_name(layer, "bias"), {"bias": bias}, {"bias": params["bias"]}))
    return records


RecordsOf = Callable[[Conv, str, Tensor, Tensor, dict[str, str]], list[LayerRecord]]


def _hook(records_of: RecordsOf, what: str) -> ForwardFn:
    """The hook body of a convolution family: its records are ``records_of(module, name, x, grad, params)``."""

    def capture(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
    ) -> None:
        x = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, C_in, *spatial)
        params = ctx.param_names(module)
        ctx.on_output_grad(output, lambda grad: records_of(module, ctx.name, x, grad, params))  # type: ignore[arg-type]

    capture.__doc__ = f"Hook body for {what}."
    return capture


capture_conv = register_capture(nn.Conv1d, nn.Conv2d, nn.Conv3d)(
    _hook(conv_records, "``nn.Conv1d/2d/3d`` (stride, padding incl. strings, padding modes, dilation, groups)")
)
capture_conv_transpose = register_capture(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)(
    _hook(
        conv_transpose_records,
        "``nn.ConvTranspose1d/2d/3d`` (stride, padding, output_padding, output_size, dilation, groups)",
    )
)
