"""Top-k by the preconditioned methods (K-FAC, EK-FAC, TRAK) through the nearest-gradient index.

Their score is an inner product after a transform of the test side: ``sum_c lr_c g_i^T P_c g_j`` with ``P_c`` the
damped inverse K-FAC / EK-FAC curvature of pass ``c``, or TRAK's kernel inverse on sketches. So the training rows
indexed once for TracIn (:mod:`.vector_index`: ``lr_i`` times the per-layer Kronecker sketches of ``g_i``) answer
them too, searched with the sketch of the preconditioned test gradient:

1. **Curvature.** ``F_c`` fitted on the train pass as :func:`.curvature.kfac_influence` fits it (kept in this
   process while the pass's shards are unchanged: :func:`fitted_curvature`).
2. **Candidates.** Each test gradient preconditioned per layer (``(F_c + delta I)^-1 g_j``:
   :func:`~metastore_plugins.core.ops.precondition.precondition`), sketched in the index's space (the same
   projections, side by side in its layer order), and the index searched with ``+q`` and ``-q``: the
   ``candidates`` rows (default :func:`candidate_count`) of largest ``<lr_i v_i, +-q_j>`` per pass, their union kept.
3. **Exact scores.** The chosen method on the union only (:func:`.curvature.preconditioned_scores` with the
   curvature of step 1), or, where every record of the layers is projected (on a curvature eigenbasis the
   index's vectors are the records, and ``q_j`` the divided record), ``<lr_i v_i, q_j>`` itself: the same
   numbers, without reading a shard.

TRAK's kernel lives on its own ``32 x 32`` summed sketches (:func:`.sketches.kernel_influence`), which the sketch
cache keeps: that matrix is its index, and one product over it scores every row; ``k=`` keeps each test sample's
``candidates`` strongest rows of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import curvature, queries, sketches
from metastore_plugins.core.analysis.index_files import open_index
from metastore_plugins.core.analysis.method_table import TRACIN
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import scan_of
from metastore_plugins.core.analysis.sketches import sketch_layers
from metastore_plugins.core.analysis.vector_index import VectorIndex, projected_only
from metastore_plugins.core.analysis.vector_search import largest
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING, CurvatureMethod, LayerCurvature
from metastore_plugins.core.ops.precondition import precondition
from metastore_plugins.core.store import StoreReader

Curvature = dict[str, LayerCurvature]


#: Training rows (of the largest train pass) from which the reports and ``metastore influence`` go through the index
#: for every method (built when missing); below, TracIn uses a kept one and the other methods score every row.
INDEX_ROWS = 20_000


def report_index(store: StoreReader, train: Sequence[str], method: str, index: bool | None) -> bool | None:
    """The ``index=`` the reports pass for ``method`` when asked ``index`` (``None``: by :data:`INDEX_ROWS`)."""
    if index is not None:
        return index
    if max((sum(ref.size for ref in store.batch_refs(cp)) for cp in train), default=0) >= INDEX_ROWS:
        return True
    return None if method == TRACIN else False


#: The preconditioned methods search this many times TracIn's candidates (``max(4 k, 50)``): on exact layers the
#: sketch of a preconditioned gradient ranks less well. Measured on a captured MLP 32-128-128-10 with exact layers
#: (20,000 rows, metastore_bench/index_methods_bench.py): EK-FAC recall@10 0.54 at 50 candidates, 0.82 at 200,
#: 0.97 at 800 (TracIn 0.94 at 50, 1.00 at 200).
PRECONDITIONED_FACTOR = 16


def candidate_count(k: int, candidates: int | None) -> int:
    """The rows searched per test sample and direction: ``candidates``, else :data:`PRECONDITIONED_FACTOR` times
    ``max(4 k, 50)`` (800 for ``k = 10``)."""
    return candidates or PRECONDITIONED_FACTOR * max(4 * k, 50)


def influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    method: str,
    k: int,
    index: bool | None = None,
    candidates: int | None = None,
    damping: float | None = None,
    relative_damping: float | None = None,
    layers: Sequence[str] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Scores:
    """``method`` (``"kfac"``, ``"ekfac"``, ``"trak"``) scored on each test sample's candidates only (module docstring).

    ``index``: ``None`` uses a kept index, ``True`` builds one when missing, ``False`` scores every row; every row
    is scored too where no index is kept (``None``) or the store is partitioned. ``.top(k)`` of the result is the
    exhaustive query's where the candidates hold its top-k.
    """
    count = candidate_count(k, candidates)
    if method == "trak":
        ridge = sketches.DEFAULT_REGULARIZATION if relative_damping is None else relative_damping
        every = sketches.kernel_influence(store, train, test, layers=layers, regularization=ridge)
        return strongest(every if test_ids is None else _columns(every, test_ids), count)
    relative = DEFAULT_RELATIVE_DAMPING if relative_damping is None else relative_damping
    chosen: CurvatureMethod = "kfac" if method == "kfac" else "ekfac"
    options: dict[str, Any] = {"damping": damping, "relative_damping": relative, "layers": layers}

    def exhaustive() -> Scores:
        return curvature.kfac_influence(store, train, test, method=chosen, test_ids=test_ids, **options)

    if index is False or scan_of(store).partitioned:
        return exhaustive()
    try:
        found = _candidates(store, train, test, chosen, index, count, test_ids, max_bytes, options)
    except StoreError as exc:  # a part changed on disk while it was read: this answer scans every row
        _warn(f"{exc}; every row is scanned")
        return exhaustive()
    if found is None:
        return exhaustive()
    ids, fitted, passes = found
    if projected_only(store, sketch_layers(store, layers)):
        row_parts, col_parts = [], []
        for opened, tested, query in passes:
            rows = np.flatnonzero(np.isin(opened.sample_ids, ids))  # (n,) every occurrence
            matrix = opened.weighted_rows(rows).astype(np.float64) @ query.astype(np.float64).T  # (n, M)
            row_parts.append((opened.sample_ids[rows], matrix))
            col_parts.append((tested, matrix))
        return queries.summed_scores(row_parts, col_parts)
    pairs = queries.selected_pairs(store, train, test, layers=layers, train_ids=ids, test_ids=test_ids)
    fitted_on = {cp: store.select(cp, layers=layers) for cp, _, _, _ in pairs}
    return curvature.preconditioned_scores(store, pairs, fitted_on, chosen, damping, relative, max_bytes, fitted=fitted)


Passes = list[tuple[VectorIndex, np.ndarray, np.ndarray]]


def _candidates(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    method: CurvatureMethod,
    index: bool | None,
    count: int,
    test_ids: Sequence[int] | None,
    max_bytes: int,
    options: dict[str, Any],
) -> tuple[list[int], dict[str, Curvature], Passes] | None:
    """``(candidate ids, curvature per train pass, (index, test ids (M,), queries (M, D)) per pass)``; ``None`` where
    a pass has no kept index and ``index`` is not ``True``."""
    order = sketch_layers(store, options["layers"])
    found: set[int] = set()
    fitted: dict[str, Curvature] = {}
    passes: Passes = []
    for train_cp, test_cp in queries.paired_points(train, test):
        opened = open_index(store, train_cp, layers=order, build=bool(index), max_bytes=max_bytes)
        if opened is None:
            return None
        if train_cp not in fitted:
            fitted[train_cp] = fitted_curvature(store, train_cp, method, options["layers"], max_bytes)
        tested, query = preconditioned_sketches(
            store, test_cp, test_ids, opened, order, fitted[train_cp], options, max_bytes
        )
        rows = opened.search(np.concatenate([query, -query]), count)  # (2M, c)
        found.update(opened.sample_ids[rows[rows >= 0]].tolist())
        passes.append((opened, tested, query))
    return sorted(found), fitted, passes


def preconditioned_sketches(
    store: StoreReader,
    capture_point: str,
    ids: Sequence[int] | None,
    opened: VectorIndex,
    order: Sequence[str],
    fitted: Curvature,
    options: dict[str, Any],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """``(sample ids (M,), q (M, D))``: each test gradient preconditioned per layer, ``(F + delta I)^-1 g_j``, then
    sketched as the index's vectors are (``opened.dim``, seed 0, the layers side by side in ``order``)."""
    selection = store.select(capture_point, sample_ids=ids, layers=list(order))
    dim, draw, width = opened.dim, ops.Projections(), opened.dim * opened.dim
    found, parts = [], []
    for batch in selection.batches():
        records = precondition(batch.records, fitted, options["damping"], options["relative_damping"], max_bytes)
        block = torch.zeros(batch.size, len(order), width)  # (B, L, dim^2)
        for record in records:
            block[:, order.index(record.layer)] += ops.sketch(
                record, dim, dim, 0, max_bytes=max_bytes, projections=draw
            )
        parts.append(block.reshape(batch.size, -1).numpy())
        found.append(batch.meta["sample_id"].numpy())
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0, len(order) * width), np.float32)
    return np.concatenate(found), np.concatenate(parts).astype(np.float32)


def fitted_curvature(
    store: StoreReader,
    capture_point: str,
    method: CurvatureMethod,
    layers: Sequence[str] | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Curvature:
    """The K-FAC / EK-FAC curvature of a train pass (:func:`.curvature.fit_curvature` on all of its samples), kept in
    this process while its batches and their shards' sha256 are unchanged: a query per test sample fits once."""
    refs = store.batch_refs(capture_point)
    binding = tuple((ref.file.name, ref.batch, store.shard_sha256(ref.file.name)) for ref in refs)
    key = (str(store.path), capture_point, method, None if layers is None else tuple(layers), max_bytes, binding)
    kept = _FITTED.get(key)
    if kept is None:
        selection = store.select(capture_point, layers=layers)
        kept = curvature.fit_curvature(selection, method, max_bytes, what=f"curvature of {capture_point!r}")
        _FITTED[key] = kept
        while len(_FITTED) > MAX_FITTED:
            _FITTED.pop(next(iter(_FITTED)))
    return kept


#: Curvatures fitted in this process (:func:`fitted_curvature`), the oldest dropped beyond :data:`MAX_FITTED`.
_FITTED: dict[tuple[Any, ...], Curvature] = {}
MAX_FITTED = 2


def strongest(scores: Scores, count: int) -> Scores:
    """The rows of ``scores`` among each column's ``count`` largest and ``count`` smallest: ``.top(k)`` for any
    ``k <= count`` is the whole matrix's."""
    count = min(count, len(scores.row_ids))
    if count == 0:
        return scores
    rows = np.union1d(largest(scores.scores, count).ravel(), largest(-scores.scores, count).ravel())  # (n,)
    return Scores(scores.scores[rows], scores.row_ids[rows], scores.col_ids)


def _columns(scores: Scores, ids: Sequence[int]) -> Scores:
    cols = np.isin(scores.col_ids, list(ids))
    return Scores(scores.scores[:, cols], scores.row_ids, scores.col_ids[cols])


def _warn(message: str) -> None:
    warnings.warn(message.splitlines()[0] if message else message, stacklevel=4)
