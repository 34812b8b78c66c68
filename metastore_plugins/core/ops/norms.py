"""Squared per-sample gradient norms, computed on the factors.

For an ``"outer"`` record (weight ``grad W_i[g] = D_i[g]^T A_i[g]``, bias ``sum_t D_i[t]``)::

    ||grad W_i||^2 = sum_g sum_{t,s} (A_i[g] A_i[g]^T)[t, s] * (D_i[g] D_i[g]^T)[t, s]
    ||grad b_i||^2 = sum_g sum_{t,s} (D_i[g] D_i[g]^T)[t, s]          # = ||sum_t D_i[t]||^2

with ``t, s`` over the ``T_i`` kept rows of sample ``i``: ``O(T_i^2 (d_in + d_out))``
instead of ``O(T_i d_in d_out)`` to rebuild. For an ``"embedding"`` record, rows
of the same ``(sample, id)`` are summed first (they hit the same weight row), then
``||grad W_i||^2 = sum_v ||sum_{r in i, id_r = v} D_r||^2``. Dense records are direct;
``"projected"`` and ``"norms"`` records hold the exact ``sq_norm`` of all their parameters together.
:func:`~metastore_plugins.core.ops.cost.plan_norms` decides per record.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from metastore_plugins.core.ops._common import (
    DEFAULT_MAX_BYTES,
    chunks,
    max_rows_per_sample,
    outer_dims,
    pad_by_sample,
    param_numel,
    restore_chunk,
    sample_slice,
    segment_sum,
    selected_roles,
    unsupported,
    whole_record,
)
from metastore_plugins.core.ops.cost import Method, plan_norms
from metastore_plugins.core.records import SUMMARY_KINDS, LayerRecord


def sq_norms_by_param(
    record: LayerRecord,
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, Tensor]:
    """Squared per-sample gradient norm of each parameter of a record.

    Args:
        record: a record of any kind (scaled to per-sample losses, e.g. from
            ``CaptureSession.factors()``).
        params: parameter names to include (all of the record's when ``None``).
        method: ``"auto"`` (cost model), ``"factored"`` or ``"dense"``; all exact.
        max_bytes: bound on the largest intermediate (samples are processed in chunks).

    Returns:
        Parameter name -> ``(B,)`` squared norms ``||grad p_i||^2``.
    """
    roles = selected_roles(record, params)
    if not roles:
        return {}
    if record.kind in SUMMARY_KINDS:
        whole_record(record, params, "squared norms")
        if len(roles) > 1:
            raise unsupported(record, "squared norms of each parameter separately")
        return {next(iter(roles.values())): record.tensors["sq_norm"]}
    plan = plan_norms(record, list(roles.values()), method)
    if plan.method == "dense":
        return _dense_norms(record, roles, max_bytes)
    if record.kind == "embedding":
        return {roles["weight"]: _embedding_norms(record)}
    return _outer_norms(record, roles, max_bytes)


def sq_norms(
    record: LayerRecord,
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """Squared per-sample gradient norm over all (selected) parameters of a record: ``(B,)``.

    See :func:`sq_norms_by_param` for the arguments. Records of one layer that share a
    parameter (several calls of a module) are combined by
    :func:`~metastore_plugins.core.ops.influence.total_sq_norms`.
    """
    if record.kind in SUMMARY_KINDS:  # exact, all parameters together
        whole_record(record, params, "squared norms")
        sq_norm = record.tensors["sq_norm"]  # (B,)
        return sq_norm if selected_roles(record, params) else torch.zeros_like(sq_norm)
    by_param = sq_norms_by_param(record, params, method, max_bytes)
    total = torch.zeros(record.batch_size, dtype=torch.float32, device=_device(record))  # (B,)
    for value in by_param.values():
        total = total + value
    return total


def _device(record: LayerRecord) -> torch.device:
    return next(iter(record.tensors.values())).device


def _outer_norms(record: LayerRecord, roles: dict[str, str], max_bytes: int) -> dict[str, Tensor]:
    """Gram form, ``n`` samples at a time padded to ``T_max`` rows."""
    groups, d_in, d_out = outer_dims(record)
    tokens = max_rows_per_sample(record)
    batch = record.batch_size
    weight_sq = torch.zeros(batch, device=_device(record))  # (B,)
    bias_sq = torch.zeros(batch, device=_device(record))  # (B,)
    per_sample = 4 * groups * tokens * (d_in + d_out + 3 * tokens)  # padded factors + 3 Gram-sized buffers
    for lo, hi in chunks(batch, max_bytes // max(1, per_sample)):
        sample, prefix, suffix = sample_slice(record, lo, hi)
        pa, pd = pad_by_sample(sample, hi - lo, prefix, suffix)  # (n, T, G, d_in), (n, T, G, d_out)
        pd = pd.transpose(1, 2)  # (n, G, T, d_out)
        dd = pd @ pd.transpose(2, 3)  # (n, G, T, T)
        if "bias" in roles:
            bias_sq[lo:hi] = dd.sum(dim=(1, 2, 3))
        if "weight" in roles:
            pa = pa.transpose(1, 2)  # (n, G, T, d_in)
            aa = pa @ pa.transpose(2, 3)  # (n, G, T, T)
            weight_sq[lo:hi] = aa.mul_(dd).sum(dim=(1, 2, 3))
    out = {}
    if "weight" in roles:
        out[roles["weight"]] = weight_sq
    if "bias" in roles:
        out[roles["bias"]] = bias_sq
    return out


def _embedding_norms(record: LayerRecord) -> Tensor:
    """Rows grouped by ``(sample, id)``: ``sum_v ||sum_{r in i, id_r = v} D_r||^2``."""
    vocab = record.param_shapes["weight"][0]
    sample = record.tensors["sample"].long()  # (R,)
    keys = sample * vocab + record.tensors["ids"].long()  # (R,)
    unique, inverse = torch.unique(keys, return_inverse=True)  # (U,), (R,)
    suffix = record.tensors["suffix"]  # (R, d)
    summed = suffix.new_zeros(unique.shape[0], suffix.shape[1]).index_add_(0, inverse, suffix)  # (U, d)
    return segment_sum(summed.pow(2).sum(1), torch.div(unique, vocab, rounding_mode="floor"), record.batch_size)


def _dense_norms(record: LayerRecord, roles: dict[str, str], max_bytes: int) -> dict[str, Tensor]:
    """Rebuild ``n`` samples at a time and square."""
    names = list(roles.values())
    per_sample = 8 * param_numel(record, names) + 1
    out = {name: torch.zeros(record.batch_size, device=_device(record)) for name in names}
    for lo, hi in chunks(record.batch_size, max_bytes // per_sample):
        for name, grad in restore_chunk(record, lo, hi, names).items():
            out[name][lo:hi] = torch.linalg.vector_norm(grad.reshape(hi - lo, -1), dim=1).pow(2)
    return out
