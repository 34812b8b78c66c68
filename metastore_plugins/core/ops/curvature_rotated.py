"""Per-sample gradients in a fitted K-FAC eigenbasis (:func:`rotated`), and EK-FAC's eigenvalue correction from them
(:class:`EigenvalueCorrection`): what preconditioning, leverages and the preconditioned index read a fitted
:class:`~.curvature.LayerCurvature` through (the notation of :mod:`.curvature`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from metastore_plugins.core.ops import curvature_eigen as eigen
from metastore_plugins.core.ops import curvature_embedding as embedding
from metastore_plugins.core.ops._common import DEFAULT_MAX_BYTES, chunks, rebuild_outer, weight_groups
from metastore_plugins.core.ops.curvature import LayerCurvature, flat_gradients, layer_groups
from metastore_plugins.core.records import LayerRecord, WeightLayout

_F64 = torch.float64


def rotated(
    group: Sequence[LayerRecord], curvature: LayerCurvature, lo: int, hi: int, dtype: torch.dtype = _F64
) -> Tensor:
    """Per-sample gradients of samples ``lo..hi-1`` of one layer in its eigenbasis, summed over its records (a new
    tensor: never a view of a record's), in ``dtype`` (float64 for the queries; the capture keeps float32 records).

    Kronecker layer: ``(n, G, d_out, d_in')`` ``Q_D^T [W_i | b_i] Q_A``, from the rotated factors
    ``(D Q_D)^T (A' Q_A)`` of factored records (rotating the gradient of dense ones); dense layer:
    ``(n, P)`` ``Q^T g_i`` (``g_i`` itself under a diagonal Fisher); embedding layer: ``(n, V, d)``
    ``Q_A^T W_i Q_D``, dense (without a full token basis, the queries here use the sparse rows of
    :mod:`.curvature_embedding` instead).
    """
    n = hi - lo
    if curvature.kind == "eigen":
        eigen.check_basis(group, curvature.basis)
        return eigen.rotated_block(group, lo, hi)  # (n, k_out, k_in)
    if curvature.kind == "embedding":
        assert curvature.q_out is not None
        return embedding.dense_rotated(group, curvature.q_out, lo, hi, curvature.q_in)  # (n, V, d)
    if curvature.kind == "dense":
        flat = sum((flat_gradients(r, lo, hi) for r in group[1:]), flat_gradients(group[0], lo, hi))  # (n, P)
        return flat if curvature.q_in is None else flat @ curvature.q_in
    assert curvature.q_in is not None and curvature.q_out is not None
    q_in, q_out = curvature.q_in.to(dtype), curvature.q_out.to(dtype)  # (G, d_in', k_in), (G, d_out, k_out)
    total: Tensor | None = None  # (n, G, k_out, k_in), from the first record's part (no zeros to add to)
    for record in group:
        if record.kind == "dense":
            blocks = _block_gradients(record, lo, hi, curvature.layout, *q_out.shape[:2]).to(dtype)
            part = q_out.transpose(1, 2) @ blocks @ q_in  # (n, G, k_out, k_in)
        else:
            sample = record.tensors["sample"].long()  # (R,)
            inside = (sample >= lo) & (sample < hi)  # (R,)
            rows = None if bool(inside.all()) else inside.nonzero().squeeze(1)  # (R_chunk,): all rows, no copy
            prefix = _rotated_prefix(record, q_in, rows)  # (R_chunk, G, k_in)
            suffix = record.tensors["suffix"] if rows is None else record.tensors["suffix"][rows]  # (R_chunk, G, d_out)
            suffix = torch.einsum("rgo,gop->rgp", suffix.to(dtype), q_out)  # (R_chunk, G, k_out)
            part = rebuild_outer(prefix, suffix, (sample if rows is None else sample[rows]) - lo, n)
        total = part if total is None else total.add_(part)
    assert total is not None  # a layer group holds at least one record
    return total


def _rotated_prefix(record: LayerRecord, q_in: Tensor, rows: Tensor | None) -> Tensor:
    """``(R_chunk, G, k_in)`` ``[A_r | 1] Q_A`` of an outer record's ``rows`` (None: all), in ``q_in``'s dtype:
    ``A_r Q_A[:d_in] + Q_A[d_in]`` (the bias's row of ones), with no augmented copy of the prefix."""
    if "weight" not in record.params:  # a bias alone: the prefix is the ones
        count = record.tensors["suffix"].shape[0] if rows is None else rows.shape[0]
        return q_in[:, -1].expand(count, *q_in[:, -1].shape)
    prefix = record.tensors["prefix"] if rows is None else record.tensors["prefix"][rows]  # (R_chunk, G, d_in)
    d_in = prefix.shape[2]
    out = torch.einsum("rgi,gij->rgj", prefix.to(q_in.dtype), q_in[:, :d_in])  # (R_chunk, G, k_in)
    return out + q_in[:, d_in] if "bias" in record.params else out


def sample_chunk(curvature: LayerCurvature, max_bytes: int) -> int:
    """Samples per chunk so that a few float64 copies of their rotated gradients stay within ``max_bytes``."""
    return max(1, max_bytes // (32 * max(1, curvature.eigenvalues.numel())))


class EigenvalueCorrection:
    """EK-FAC: ``(1/N) sum_i (Q_D^T [W_i | b_i] Q_A)^2`` over training batches, in a fitted K-FAC eigenbasis."""

    def __init__(self, curvature: dict[str, LayerCurvature]) -> None:
        self.curvature = curvature
        self.sums = {layer: torch.zeros_like(c.eigenvalues) for layer, c in curvature.items() if c.kind != "dense"}
        self.samples = dict.fromkeys(self.sums, 0)

    def add(self, records: Sequence[LayerRecord], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """Add one batch's squared rotated per-sample gradients (in sample chunks within ``max_bytes``)."""
        for layer, group in layer_groups(records).items():
            if layer not in self.sums:
                continue
            curvature = self.curvature[layer]
            if curvature.kind == "embedding" and curvature.q_in is None:  # sparse: the diagonal token factor
                assert curvature.q_out is not None
                embedding.add_squared_rotated(self.sums[layer], group, curvature.q_out)  # (V, d)
                self.samples[layer] += group[0].batch_size
                continue
            for lo, hi in chunks(group[0].batch_size, sample_chunk(curvature, max_bytes)):
                self.sums[layer] += rotated(group, curvature, lo, hi).square_().sum(0)  # (G, d_out, d_in'), in place
            self.samples[layer] += group[0].batch_size

    def fit(self) -> dict[str, LayerCurvature]:
        """The curvature with EK-FAC's corrected eigenvalues for every layer that saw a batch."""
        out = dict(self.curvature)
        for layer, sums in self.sums.items():
            if self.samples[layer]:
                c = self.curvature[layer]
                out[layer] = replace(c, eigenvalues=sums / self.samples[layer])
        return out


def _block_gradients(record: LayerRecord, lo: int, hi: int, layout: WeightLayout, groups: int, d_out: int) -> Tensor:
    """``(n, G, d_out, d_in')`` float64 ``[W_i | b_i]`` of samples ``lo..hi-1`` of a dense record (factored layer)."""
    n, parts = hi - lo, []
    if "weight" in record.params:
        weight = record.dense_grad("weight")[lo:hi].to(_F64)  # (n, *shape)
        d_in = weight[0].numel() // (groups * d_out)
        parts.append(weight_groups(weight, layout, groups, d_out, d_in))  # (n, G, d_out, d_in)
    if "bias" in record.params:
        parts.append(record.dense_grad("bias")[lo:hi].to(_F64).reshape(n, groups, d_out, 1))
    return torch.cat(parts, 3)
