"""Building records from a layer's factors: the conventions every capture rule shares.

Mixed precision: every rule reads its operands through :func:`as_computed`, the layer input
rounded to the dtype the layer computed in, then both factors upcast to fp32 before any product.
Rows whose suffix is exactly zero (padding, positions the loss never reads) add nothing to
``grad W_i = sum_t D_i[t]^T A_i[t]`` and are dropped (:func:`kept_rows`); a layer whose dense
per-sample gradients take fewer bytes than its kept factor rows is stored dense
(:func:`dense_is_smaller`). The record kinds themselves: :mod:`metastore_plugins.core.records`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from metastore_plugins.core.records import LayerRecord, RecordHead, WeightLayout, dense_from_factors


def as_computed(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` as a layer that computed in ``dtype`` read it, in fp32: every rule's mixed-precision convention.

    Autocast runs a Linear, a convolution or an attention projection in its low-precision dtype,
    which is the dtype of the layer's output and so of the output gradient, and rounds the layer's
    input to it. Rounding a saved input the same way and upcasting every factor to fp32 (exact)
    before any product makes each per-sample gradient the exact gradient of the function autocast
    computed, rounded once to fp32, and never multiplies tensors of two dtypes. Tensors of an fp32
    layer come back as they are (no copy), ids unchanged.

    Args:
        tensor: a layer input, or an output gradient (for which ``dtype`` is its own dtype).
        dtype: the dtype the layer computed in: that of its output gradient.
    """
    if not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype).float()


def kept_rows(suffix: Tensor) -> Tensor:
    """Indices of rows of a ``(R, ...)`` suffix that are not exactly zero (rows holding NaN are kept)."""
    flat = suffix.reshape(suffix.shape[0], math.prod(suffix.shape[1:]))  # (R, rest), also for R = 0
    return nonzero_rows(flat).nonzero().squeeze(1)  # (R_kept,)


def nonzero_rows(tensor: Tensor, dim: int = 1) -> Tensor:
    """Bool, ``dim`` reduced: whether each slice along ``dim`` has an entry that is not exactly zero (NaN counts).

    ``max != 0 or min != 0``: two reductions that allocate nothing, 5x faster than
    ``tensor.ne(0).any(dim)``, which builds a boolean copy of the whole tensor.
    """
    return tensor.amax(dim=dim).ne(0) | tensor.amin(dim=dim).ne(0)


def dense_is_smaller(
    rows: int, groups: int, d_in: int, d_out: int, batch: int, param_shapes: dict[str, tuple[int, ...]]
) -> bool:
    """Whether ``batch`` dense fp32 per-sample gradients take fewer bytes than ``rows`` kept factor rows.

    A factor row holds ``G (d_in + d_out)`` floats plus its sample and position (two int32).
    """
    factored_bytes = rows * (4 * groups * (d_in + d_out) + 8)
    return factored_bytes > batch * 4 * sum(math.prod(shape) for shape in param_shapes.values())


def outer_record(
    layer: str,
    prefix: Tensor,
    suffix: Tensor,
    params: dict[str, str],
    param_shapes: dict[str, tuple[int, ...]],
    layout: WeightLayout = "out_in",
    choose_smaller: bool = True,
    pack: bool = True,
) -> LayerRecord:
    """Build an ``"outer"`` record from token-major factors, dropping zero-suffix rows.

    Args:
        prefix: ``(B, T, G, d_in)`` layer inputs per sample and position, in any float dtype: they are
            rounded to the suffix's dtype, the dtype the layer computed in (:func:`as_computed`).
        suffix: ``(B, T, G, d_out)`` output gradients per sample and position.
        choose_smaller: return the dense record instead when it takes fewer bytes.
        pack: drop the zero-suffix rows (padding). ``False`` keeps all ``B T`` rows, for a record that
            is only summarized (projected, norms) before it is stored: zero rows add nothing to those,
            and whole ``(B, T)`` blocks need no scatter. :func:`packed` drops them later if needed.
    """
    head = RecordHead(layer, params, param_shapes, layout)
    computed_in = suffix.dtype
    batch, tokens = suffix.shape[0], suffix.shape[1]
    groups, d_in, d_out = prefix.shape[2], prefix.shape[3], suffix.shape[3]
    flat_prefix = prefix.reshape(batch * tokens, groups, d_in)  # (B*T, G, d_in)
    flat_suffix = suffix.reshape(batch * tokens, groups, d_out)  # (B*T, G, d_out)
    if not pack:
        rows = torch.arange(batch * tokens, device=suffix.device)  # (B*T,)
        return _outer(head, flat_prefix, flat_suffix, rows, tokens, batch)
    rows = kept_rows(flat_suffix)  # (R,)
    if choose_smaller and dense_is_smaller(
        rows.numel(), groups, d_in, d_out, batch, param_shapes
    ):  # before copying rows
        return dense_from_factors(head, as_computed(prefix, computed_in), as_computed(suffix, computed_in))
    return _outer(head, flat_prefix.index_select(0, rows), flat_suffix.index_select(0, rows), rows, tokens, batch)


def _outer(
    head: RecordHead, prefix_rows: Tensor, suffix_rows: Tensor, rows: Tensor, tokens: int, batch: int
) -> LayerRecord:
    """The ``"outer"`` record of kept rows ``(R, G, d)`` at flat positions ``rows`` (``sample * T + position``)."""
    computed_in = suffix_rows.dtype
    return LayerRecord(
        layer=head.layer,
        kind="outer",
        batch_size=batch,
        params=head.params,
        param_shapes=head.param_shapes,
        layout=head.layout,
        tensors={
            "prefix": as_computed(prefix_rows, computed_in),
            "suffix": as_computed(suffix_rows, computed_in),
            "sample": torch.div(rows, tokens, rounding_mode="floor").int(),
            "position": torch.remainder(rows, tokens).int(),
        },
    )


def packed(record: LayerRecord) -> LayerRecord:
    """An ``"outer"`` record without its zero-suffix rows (``outer_record(pack=False)`` keeps them)."""
    if record.kind != "outer":
        return record
    keep = kept_rows(record.tensors["suffix"])  # (R_kept,)
    if keep.numel() == record.tensors["suffix"].shape[0]:
        return record
    return replace(record, tensors={key: value.index_select(0, keep) for key, value in record.tensors.items()})
