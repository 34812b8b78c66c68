"""Self-influence through a curvature or a kernel inverse: how unusual each training sample is for its training set.

TracIn's self-influence ``sum_c lr_c ||g_i(w_c)||^2`` ranks samples by the size of their gradient. The
two queries here measure it in the metric of the training set's own curvature, as influence functions
do (Koh & Liang 2017; Kronfluence ranks mislabelled samples this way):

- :func:`preconditioned_self_influence`: ``sum_c lr_c g_i(w_c)^T (F_c + delta I)^-1 g_i(w_c)``, ``F_c`` the
  K-FAC / EK-FAC curvature fitted on pass ``c`` (:func:`~.curvature.fit_curvature`), exact records only;
- :func:`kernel_self_influence`: TRAK's leverage ``sum_c lr_c s_i^T (S_c^T S_c + lambda_c I)^-1 s_i`` on the
  pass's Kronecker sketches ``S_c``, the ridge of :meth:`kernel_influence`.

Both are aligned as :func:`~.queries.self_influence` is (one pass: its selection order, several: per sample id,
:func:`~.queries.self_influence_ids`), take its filters (``**where``) and read through the store's scan, so they
run partitioned by shard too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.analysis.curvature import fit_curvature
from metastore_plugins.core.analysis.per_batch import positive_int, positive_number
from metastore_plugins.core.analysis.queries import summed_by_id
from metastore_plugins.core.analysis.scan import scan_of
from metastore_plugins.core.analysis.sketches import DEFAULT_REGULARIZATION, check_seed, sketches
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.curvature import (
    CURVATURE_METHODS,
    DEFAULT_RELATIVE_DAMPING,
    CurvatureMethod,
    LayerCurvature,
)
from metastore_plugins.core.ops.leverage import leverages, preconditioned_sq_norms
from metastore_plugins.core.store import Selection, StoreReader


def _points(capture_point: str | Sequence[str]) -> list[str]:
    points = [capture_point] if isinstance(capture_point, str) else list(capture_point)
    if not points or not all(isinstance(p, str) for p in points):
        raise ConfigError(f"capture_point must be a capture point name or a list of them, got {capture_point!r}")
    return points


def _learning_rates(selection: Selection) -> np.ndarray:
    """``(N,)`` each selected sample's batch learning rate (1 where none was recorded), in selection order."""
    rates = [np.full(b.size, b.ref.lr_weight) for b in selection.batches(with_records=False)]
    return np.concatenate(rates) if rates else np.zeros(0)


def preconditioned_self_influence(
    store: StoreReader,
    capture_point: str | Sequence[str],
    *,
    method: CurvatureMethod = "ekfac",
    damping: float | None = None,
    relative_damping: float = DEFAULT_RELATIVE_DAMPING,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    **where: Any,
) -> np.ndarray:
    """Self-influence ``sum_c lr_c g_i(w_c)^T (F_c + delta I)^-1 g_i(w_c)`` with K-FAC or EK-FAC ``F_c``.

    Per layer (``F_c`` is block-diagonal) it is ``sum (Q^T g_i)^2 / (Lambda + delta)`` in the curvature's
    eigenbasis (:func:`~metastore_plugins.core.ops.leverage.preconditioned_sq_norms`): no dense inverse.

    Args:
        capture_point: one pass, or several (checkpoint passes) summed per sample id.
        method: ``"ekfac"`` (eigenvalues corrected to the per-sample gradients' second moments; two
            reads of each pass to fit) or ``"kfac"`` (one read).
        damping: one absolute ``delta`` for every layer; by default each layer's is ``relative_damping``
            times the mean eigenvalue of its curvature (Kronfluence's rule, as :meth:`kfac_influence`).
        layers: restrict to these layers (all by default; seeded projections and norms cannot be fitted).
        where: :meth:`select`'s filters (``sample_ids=``, ``steps=``, ``epochs=``) of the scored samples;
            ``F_c`` is fitted on every sample of pass ``c`` whatever they are.

    Returns:
        ``(N,)`` aligned with ``sample_ids(capture_point, **where)`` for one pass, with
        :meth:`self_influence_ids` for several; NaN for a batch that holds no records.

    Raises:
        ValueError: for an unknown method, a non-positive damping, or a layer K-FAC cannot fit (named).
        RepresentationError: for a seeded-projection or norms-only layer (leave it out with ``layers=``).
    """
    if method not in CURVATURE_METHODS:
        raise ConfigError(f"method must be one of {CURVATURE_METHODS}, got {method!r}")
    damping = None if damping is None else positive_number("damping", damping)
    relative_damping = positive_number("relative_damping", relative_damping)
    scan, parts = scan_of(store), []
    for point in _points(capture_point):
        what = f"preconditioned self_influence of {point!r}"
        whole = store.select(point, layers=layers)
        curvature = fit_curvature(whole, method, max_bytes, scan, f"curvature of {point!r}")
        selection = store.select(point, layers=layers, **where)
        part = scan.part(selection, what)
        local = _lr_preconditioned(part.selection, curvature, damping, relative_damping, max_bytes)  # (n,)
        parts.append((selection.sample_ids(), scan.gather(local, part, what)))
    return summed_by_id(parts)


def _lr_preconditioned(
    selection: Selection,
    curvature: dict[str, LayerCurvature],
    damping: float | None,
    relative_damping: float,
    max_bytes: int,
) -> np.ndarray:
    """``(N,)`` ``lr_b g_i^T (F + delta I)^-1 g_i`` of a selection's samples, in selection order (NaN: no records)."""
    values = []
    for run, records in selection.merged(max_bytes // 2):
        sizes = [b.size for b in run]
        if not records:  # batches kept as "nothing" (capture policy)
            values.append(np.full(sum(sizes), np.nan))
            continue
        lr = np.repeat([b.ref.lr_weight for b in run], sizes)  # (n,)
        found = preconditioned_sq_norms(records, curvature, damping, relative_damping, max_bytes)  # (n,)
        values.append(lr * found.numpy())
    return np.concatenate(values) if values else np.zeros(0)


def kernel_self_influence(
    store: StoreReader,
    capture_point: str | Sequence[str],
    *,
    dim: int = 32,
    seed: int = 0,
    regularization: float = DEFAULT_REGULARIZATION,
    layers: Sequence[str] | None = None,
    cache: bool = True,
    **where: Any,
) -> np.ndarray:
    """TRAK's leverage ``sum_c lr_c s_i^T (S_c^T S_c + lambda_c I)^-1 s_i`` on Kronecker sketches.

    ``S_c`` ``(N, k)`` are the summed sketches (``k = dim^2``, :meth:`sketches`) of every sample of pass ``c``,
    ``s_i`` sample ``i``'s row, ``lambda_c = regularization * tr(S_c^T S_c) / k`` (``regularization`` times the
    mean eigenvalue): the kernel and ridge of :meth:`kernel_influence`, each sample scored against itself
    (:func:`~metastore_plugins.core.ops.leverage.leverages`). One ``(k, k)`` solve per pass; the whole pass's
    sketches come from the sketch cache unless ``cache=False``.

    Args:
        capture_point: one pass, or several summed per sample id (aligned as :func:`preconditioned_self_influence`).
        where: :meth:`select`'s filters of the scored samples; the kernel is of the whole pass.

    Raises:
        ValueError: for a non-positive ``dim`` or ``regularization``, or a seed that is not an integer.
    """
    dim, seed = positive_int("dim", dim), check_seed(seed)
    regularization = positive_number("regularization", regularization)
    where = {name: value for name, value in where.items() if value is not None}
    parts = []
    for point in _points(capture_point):
        train = torch.from_numpy(sketches(store, point, dim, seed, layers, cache=cache))  # (N, k) float64
        rows = torch.from_numpy(sketches(store, point, dim, seed, layers, **where)) if where else train  # (n, k)
        selection = store.select(point, layers=layers, **where)
        values = _learning_rates(selection) * leverages(train, rows, regularization).numpy()  # (n,)
        parts.append((selection.sample_ids(), values))
    return summed_by_id(parts)
