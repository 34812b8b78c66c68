"""Self-products through an inverse: ``g_i^T M^-1 g_i``, how unusual a sample's gradient is for its training set.

- :func:`preconditioned_sq_norms`: ``g_i^T (F + delta I)^-1 g_i`` with the K-FAC / EK-FAC curvature
  ``F`` of :mod:`.curvature`, block-diagonal, so summed over layers. In a layer's eigenbasis
  ``F = Q diag(Lambda) Q^T`` (for a factored layer ``Q = Q_D ⊗ Q_A``), hence
  ``g^T (F + delta I)^-1 g = sum (Q^T g)^2 / (Lambda + delta)``: the rotated gradient
  (:func:`~.curvature_rotated.rotated`, from the rotated factors) squared and scaled; nothing is rotated back.
- :func:`kernel_solve`, :func:`leverages`: TRAK's ridge kernel on sketches ``S`` ``(N, k)`` of the training
  samples, ``(S^T S + lambda I)^-1`` with ``lambda = regularization * tr(S^T S) / k`` (``regularization``
  times the mean eigenvalue of ``S^T S``); a row ``s``'s leverage is ``s^T (S^T S + lambda I)^-1 s``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import curvature_embedding as embedding
from metastore_plugins.core.ops._common import DEFAULT_MAX_BYTES, chunks
from metastore_plugins.core.ops.curvature import (
    DEFAULT_RELATIVE_DAMPING,
    LayerCurvature,
    layer_groups,
)
from metastore_plugins.core.ops.curvature_rotated import rotated, sample_chunk
from metastore_plugins.core.records import LayerRecord

#: the ridge's floor, so that all-zero sketches still solve
_MIN_RIDGE = 1e-300


def preconditioned_sq_norms(
    records: Sequence[LayerRecord],
    curvature: dict[str, LayerCurvature],
    damping: float | None = None,
    relative_damping: float = DEFAULT_RELATIVE_DAMPING,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """``(B,)`` float64 ``sum_l g_il^T (F_l + delta_l I)^-1 g_il = sum_l sum (Q_l^T g_il)^2 / (Lambda_l + delta_l)``.

    One batch's records (every layer of the sum); ``delta_l`` is :meth:`LayerCurvature.damping` of
    ``damping`` / ``relative_damping``, as :func:`~.precondition.precondition` takes it.

    Raises:
        ValueError: for no records, or a layer without fitted curvature (named).
    """
    total: Tensor | None = None
    for layer, group in layer_groups(records).items():
        c = curvature.get(layer)
        if c is None:
            raise ConfigError(f"layer '{layer}' has no fitted curvature; fit on records holding it, or leave it out")
        delta = c.damping(damping, relative_damping)
        if c.kind == "embedding" and c.q_in is None:  # sparse: one row per distinct (sample, token), no (V, d) gradient
            assert c.q_out is not None
            part = embedding.preconditioned_self_products(group, c.q_out, c.eigenvalues, delta).to(torch.float64)
            total = part if total is None else total + part
            continue
        denominator = c.eigenvalues + delta  # (G, d_out, d_in'), (k_out, k_in) or (P,)
        parts = [torch.zeros(0, dtype=torch.float64)]
        for lo, hi in chunks(group[0].batch_size, sample_chunk(c, max_bytes)):
            scaled = rotated(group, c, lo, hi).square() / denominator  # (n, G, d_out, d_in') or (n, P)
            parts.append(scaled.flatten(1).sum(1))  # (n,)
        part = torch.cat(parts)  # (B,)
        total = part if total is None else total + part
    if total is None:
        raise ConfigError("preconditioned_sq_norms needs at least one record")
    return total


def kernel_solve(train: Tensor, test: Tensor, regularization: float) -> Tensor:
    """``(k, M)`` ``(S^T S + lambda I)^-1 T^T``, ``lambda = regularization * tr(S^T S) / k``.

    ``train`` ``S`` ``(N, k)`` and ``test`` ``T`` ``(M, k)`` sketches (float64 for a sound solve).
    """
    gram = train.T @ train  # (k, k)
    ridge = regularization * float(torch.trace(gram)) / gram.shape[0]
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)  # (k, k)
    return torch.linalg.solve(gram + max(ridge, _MIN_RIDGE) * eye, test.T)  # (k, M)


def leverages(train: Tensor, rows: Tensor, regularization: float) -> Tensor:
    """``(n,)`` ``r_i^T (S^T S + lambda I)^-1 r_i`` of sketches ``rows`` ``(n, k)`` against the kernel of ``train``
    ``S`` ``(N, k)`` (:func:`kernel_solve`); ``rows = train`` gives TRAK's leverage scores of the training set."""
    return (rows * kernel_solve(train, rows, regularization).T).sum(1)  # (n,)
