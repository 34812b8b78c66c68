"""``(F + delta I)^-1 g``: gradients preconditioned by a fitted K-FAC / EK-FAC curvature (:mod:`.curvature`).

In a layer's eigenbasis ``F = Q diag(Lambda) Q^T``, so ``(F + delta I)^-1 g = Q [(Q^T g) / (Lambda + delta)]``;
for a factored layer ``Q_D [(Q_D^T [W | b] Q_A) / (Lambda + delta)] Q_A^T``, built from the rotated factors
(no ``(d_out d_in)^2`` matrix). An embedding layer stays sparse (:mod:`.curvature_embedding`), except one with a
full token basis: ``Q_A [(Q_A^T W Q_D) / (Lambda + delta)] Q_D^T``, dense; records on a curvature eigenbasis are
divided where they are (:mod:`.curvature_eigen`). ``power = 1/2`` gives the symmetric square root,
``Q [(Q^T g) / sqrt(Lambda + delta)]``: ``<S g_i, S g_j> = g_i^T (F + delta I)^-1 g_j``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import curvature_eigen as eigen
from metastore_plugins.core.ops import curvature_embedding as embedding
from metastore_plugins.core.ops._common import DEFAULT_MAX_BYTES, chunks
from metastore_plugins.core.ops.curvature import (
    DEFAULT_RELATIVE_DAMPING,
    LayerCurvature,
    layer_groups,
)
from metastore_plugins.core.ops.curvature_rotated import rotated, sample_chunk
from metastore_plugins.core.records import LayerRecord, dense_key


def _dense_record(record: LayerRecord, curvature: LayerCurvature, values: Tensor) -> LayerRecord:
    """A ``"dense"`` record of ``record``'s parameters from ``(B, G, d_out, d_in')`` or ``(B, P)`` values."""
    batch, tensors = values.shape[0], {}
    dtype = record.tensors["suffix" if record.kind != "dense" else dense_key(next(iter(record.params)))].dtype
    if curvature.kind == "embedding":  # a full token basis: (B, V, d), the weight's own shape
        tensors[dense_key("weight")] = values.reshape(batch, *record.param_shapes["weight"])
    elif curvature.kind == "dense":
        start = 0
        for role in record.params:
            size = math.prod(record.param_shapes[role])
            tensors[dense_key(role)] = values[:, start : start + size].reshape(batch, *record.param_shapes[role])
            start += size
    else:
        groups, d_out, d_in = values.shape[1], values.shape[2], values.shape[3] - ("bias" in record.params)
        if "weight" in record.params:
            weight = values[..., :d_in].reshape(batch, groups * d_out, d_in)
            if curvature.layout == "in_out":
                weight = weight.transpose(1, 2)  # (B, d_in, d_out)
            tensors[dense_key("weight")] = weight.reshape(batch, *record.param_shapes["weight"])
        if "bias" in record.params:
            tensors[dense_key("bias")] = values[..., -1].reshape(batch, *record.param_shapes["bias"])
    tensors = {key: value.to(dtype).contiguous() for key, value in tensors.items()}
    return LayerRecord(record.layer, "dense", batch, dict(record.params), dict(record.param_shapes), tensors)


def precondition(
    records: Sequence[LayerRecord],
    curvature: dict[str, LayerCurvature],
    damping: float | None = None,
    relative_damping: float = DEFAULT_RELATIVE_DAMPING,
    max_bytes: int = DEFAULT_MAX_BYTES,
    power: float = 1.0,
) -> list[LayerRecord]:
    """``(F_l + delta_l I)^-power g_i`` (default ``power = 1``: the inverse) for every layer ``l`` of one batch: one
    ``"dense"`` record per layer (an embedding layer: one ``"embedding"`` record, a row per distinct token of each
    sample).

    ``<g_j, (F + delta I)^-1 g_i>`` is then :func:`~metastore_plugins.core.ops.total_dots` of other
    records against these (factored x dense, nothing rebuilt on that side). The result holds the
    batch's dense gradients (``B P`` numbers per layer; ``U d`` for an embedding's ``U`` distinct
    (sample, token) rows), in the records' dtype.

    Raises:
        ValueError: if a layer has no fitted curvature (name it in the fit, or leave it out with ``layers=``).
    """
    out = []
    for layer, group in layer_groups(records).items():
        c = curvature.get(layer)
        if c is None:
            raise ConfigError(f"layer '{layer}' has no fitted curvature; fit on records holding it, or leave it out")
        delta = c.damping(damping, relative_damping)
        if c.kind == "embedding" and c.q_in is None:  # sparse: the diagonal token factor
            assert c.q_out is not None
            out.append(embedding.preconditioned_rows(group, c.q_out, c.eigenvalues, delta, power))
            continue
        denominator = (c.eigenvalues + delta) ** power  # (G, d_out, d_in') or (P,)
        parts = []
        for lo, hi in chunks(group[0].batch_size, sample_chunk(c, max_bytes)):
            scaled = rotated(group, c, lo, hi) / denominator  # (n, G, d_out, d_in') or (n, P)
            if c.kind == "outer":
                assert c.q_in is not None and c.q_out is not None
                scaled = c.q_out @ scaled @ c.q_in.transpose(1, 2)  # (n, G, d_out, d_in')
            elif c.kind == "embedding":
                assert c.q_in is not None and c.q_out is not None
                scaled = c.q_in @ scaled @ c.q_out.T  # (n, V, d)
            elif c.q_in is not None:
                scaled = scaled @ c.q_in.T  # (n, P)
            parts.append(scaled)
        kept = eigen.preconditioned(group, torch.cat(parts)) if c.kind == "eigen" else None
        out.append(kept or _dense_record(group[0], c, torch.cat(parts)))
    return out
