"""Influence through K-FAC / EK-FAC curvature fitted on the checkpoint passes' stored factors.

For each paired checkpoint pass ``c`` (train and test gradients at the same weights), the curvature
``F_c`` is fitted on that pass's training records (:mod:`metastore_plugins.core.ops.curvature`),
each test gradient is preconditioned, ``(F_c + delta I)^-1 g_test``, and scored against every
training gradient on its factors (under a partitioned scan one rank fits ``F_c`` and preconditions
the test gradients, every rank scores its shards). Passes are summed with TracIn's learning-rate weights:
``sum_c lr_c g_train_i(w_c)^T (F_c + delta_c I)^-1 g_test_j(w_c)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from metastore_plugins.core.analysis.queries import scored_pairs, selected_pairs, whole
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import ColumnBatch
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.curvature import (
    CURVATURE_METHODS,
    DEFAULT_RELATIVE_DAMPING,
    CurvatureMethod,
    CurvatureSums,
    EigenvalueCorrection,
    LayerCurvature,
    precondition,
)
from metastore_plugins.core.store import Selection, StoreReader


def fit_curvature(
    selection: Selection, method: CurvatureMethod = "ekfac", max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, LayerCurvature]:
    """Per layer, the K-FAC (one read of the selection) or EK-FAC (two reads) curvature of its samples."""
    sums = CurvatureSums()
    for batch in selection.batches():
        sums.add(batch.records)
    curvature = sums.fit()
    if method == "ekfac":
        correction = EigenvalueCorrection(curvature)
        for batch in selection.batches():
            correction.add(batch.records, max_bytes)
        curvature = correction.fit()
    return curvature


def _preconditioned_chunks(
    cols: Selection,
    curvature: dict[str, LayerCurvature],
    damping: float | None,
    relative_damping: float,
    max_bytes: int,
) -> Iterator[list[ColumnBatch]]:
    """The column batches, preconditioned, grouped so that each group's dense gradients take about ``max_bytes``."""
    group: list[ColumnBatch] = []
    used = 0
    for batch in cols.batches():
        records = precondition(batch.records, curvature, damping, relative_damping, max_bytes)
        size = sum(r.nbytes for r in records)
        if group and used + size > max_bytes:
            yield group
            group, used = [], 0
        group.append((batch.size, records))
        used += size
    if group:
        yield group


def kfac_influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    method: CurvatureMethod = "ekfac",
    damping: float | None = None,
    relative_damping: float = DEFAULT_RELATIVE_DAMPING,
    max_bytes: int = DEFAULT_MAX_BYTES,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
) -> Scores:
    """Influence ``sum_c lr_c g_train_i(w_c)^T (F_c + delta I)^-1 g_test_j(w_c)`` with K-FAC or EK-FAC ``F_c``.

    Args:
        train, test: capture points paired in order, as :meth:`influence` pairs them; ``F_c`` is fitted
            on all of the train pass's samples (whatever ``train_ids``), ``lr_c`` is its batches' rate.
        method: ``"ekfac"`` (eigenvalues corrected to the per-sample gradients' second moments in the
            Kronecker eigenbasis; two reads of each train pass) or ``"kfac"`` (one read).
        damping: one absolute ``delta`` for every layer; by default each layer's is ``relative_damping``
            times the mean eigenvalue of its curvature (Kronfluence's rule, 0.1).
        layers: restrict to these layers (all by default; embedding records are not fitted yet).
        train_ids, test_ids: restrict the scored samples.

    Raises:
        ValueError: for an unknown method, a non-positive damping, or a layer K-FAC cannot fit.
    """
    if method not in CURVATURE_METHODS:
        raise ValueError(f"method must be one of {CURVATURE_METHODS}, got {method!r}")
    for name, value in (("damping", damping), ("relative_damping", relative_damping)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")

    def preconditioned(train_cp: str, cols: Selection) -> Iterator[list[ColumnBatch]]:
        curvature = fit_curvature(store.select(train_cp, layers=layers), method, max_bytes)
        return _preconditioned_chunks(cols, curvature, damping, relative_damping, max_bytes // 2)

    pairs = selected_pairs(store, train, test, layers=layers, train_ids=train_ids, test_ids=test_ids)
    return whole(scored_pairs(store, pairs, columns=preconditioned, max_bytes=max_bytes))
