"""Top-k by the preconditioned methods (K-FAC, EK-FAC, TRAK) through a nearest-gradient index.

Their score is an inner product after a transform: ``sum_c lr_c g_i^T P_c g_j`` with ``P_c`` the damped inverse
K-FAC / EK-FAC curvature of pass ``c``, or TRAK's kernel inverse on sketches. With ``S_c = P_c^(1/2)`` it is
``lr_c <S_c g_i, S_c g_j>``, so the training rows are indexed whitened (:mod:`.index_preconditioned`):

1. **Curvature.** ``F_c`` fitted on the train pass as :func:`.curvature.kfac_influence` fits it (kept in this
   process while the pass's shards are unchanged: :func:`~.index_preconditioned.fitted_curvature`).
2. **Candidates.** The pass's preconditioned index (``lr_i`` times the sketches of ``S_c g_i``, built once and kept
   in this process) searched with the sketch of ``S_c g_j`` (``+q`` and ``-q``): the ``candidates`` rows (default
   :func:`candidate_count`) of largest ``<lr_i v_i, +-q_j>`` per pass, their union kept. Where they are ranked by
   their estimates (:func:`_refined`), half as many are searched (at least 48 ``max(4k, 50)``) and the pass's
   ``candidates`` rows of largest norm (:meth:`~.index_preconditioned.WhitenedIndex.heaviest`) join them: a sketch
   errs by about ``|S g_i| |S g_j| / dim``, so a heavy row's top score can sit anywhere in its ranking (10^6 rows of
   the benchmark's MLP: recall@10 0.975 in 37 ms a query, 0.93 in 43-46 ms before).
3. **Exact scores.** The chosen method on the union only, without reading a shard where the index keeps the
   rows' rotated factors (every record a one-row Kronecker record: :mod:`.index_factors`) or every record of the
   layers is projected (on a curvature eigenbasis the index's vectors are the whitened records, and ``q_j`` the
   whitened test record: ``<lr_i v_i, q_j>`` is the score); else :func:`.curvature.preconditioned_scores` with the
   curvature of step 1, which reads the shards holding the candidates.

Before, the TracIn index's rows (raw ``g_i``) were searched with the sketch of ``P_c g_j``: on exact layers of a
captured MLP (metastore_bench/index_methods_bench.py) a single test sample's query found 46% of the exhaustive
top-10 at 200 candidates of 20,000 rows, the preconditioned index 89% (see :data:`PRECONDITIONED_FACTOR`).

TRAK's kernel lives on its own ``32 x 32`` summed sketches (:func:`.sketches.kernel_influence`), which the sketch
cache keeps: that matrix is its index, and one product over it scores every row; ``k=`` keeps each test sample's
``candidates`` strongest rows of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from metastore_plugins.core.analysis import curvature, queries, sketches
from metastore_plugins.core.analysis.index_factors import low_rank
from metastore_plugins.core.analysis.index_files import default_dim, index_head, warn_line
from metastore_plugins.core.analysis.index_preconditioned import (
    QuerySide,
    WhitenedIndex,
    fitted_curvature,
    index_fits,
    index_key,
    kept_index,
    preconditioned_index,
    query_side,
)
from metastore_plugins.core.analysis.method_table import TRACIN, MethodArgs, Points
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import scan_of
from metastore_plugins.core.analysis.sketches import sketch_layers
from metastore_plugins.core.analysis.vector_index import default_candidates, projected_only
from metastore_plugins.core.analysis.vector_search import largest
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING, CurvatureMethod, LayerCurvature
from metastore_plugins.core.store import StoreReader
from metastore_plugins.core.store.vectors import vector_files as vf

Curvature = dict[str, LayerCurvature]


#: Training rows (of the largest train pass) from which the reports and ``metastore influence`` go through TracIn's
#: index (built when missing); below, through a kept one.
INDEX_ROWS = 20_000


def report_index(store: StoreReader, train: Sequence[str], method: str, index: bool | None) -> bool | None:
    """The ``index=`` the reports pass for ``method`` when asked ``index`` (``None``: TracIn by :data:`INDEX_ROWS`).

    The other methods score every row unless asked: the reports ask one question per process, and their
    preconditioned index (not kept on disk) costs its curvature fit and build before it saves a scan (measured
    first queries: 61 s against the exhaustive 26 s at 20,000 rows, 203 s against 69 s at 100,000; docs/queries.md).
    """
    if index is not None:
        return index
    if method != TRACIN:
        return False
    rows = max((sum(ref.size for ref in store.batch_refs(cp)) for cp in train), default=0)
    return True if rows >= INDEX_ROWS else None


#: The preconditioned methods search this many times TracIn's candidates (``max(4 k, 50)``,
#: :func:`~.vector_index.default_candidates`): whitened rows spread over thousands of directions, so their sketch
#: ranks less well than raw gradients'. Measured on a captured MLP
#: 32-128-128-10 with exact layers, each test sample asked alone (metastore_bench/index_methods_bench.py,
#: 2026-11-29): EK-FAC recall@10 through the float32 sketches at 200 / 800 / 1,600 candidates 0.89 / 0.97 / 0.99 of
#: 20,000 rows, 0.83 / 0.95 / 0.97 of 100,000 (3,200: 0.98); through their product-quantized codes (what FAISS
#: keeps from :data:`~.index_preconditioned.COMPRESS_ABOVE`, projected) 0.92 / 0.95 / 0.96 at 1,600 / 2,400 / 3,200
#: of 100,000, 0.77 / 0.86 / 0.91 at 2,400 / 9,600 / 19,200 of 10^6; the old rule (the TracIn index searched with
#: the sketch of ``P g_j``) 0.39 / 0.77 / 0.88 and 0.25 / 0.50 / 0.64.
PRECONDITIONED_FACTOR = 48
#: ... and at least one row in this many of the pass's: at a fixed count recall falls as more rows compete (10^6 rows
#: of that MLP, the projected codes: each test sample's candidates held 0.77 / 0.91 / 0.96 / 0.985 of its exhaustive
#: top-10 at 2,400 / 19,200 / 38,400 / 76,800 each way; 10^5 rows: 0.95 / 0.96 at 2,400 / 3,200). The rank-4
#: estimates of a test sample's candidates cost about 0.45 us a row (the gather of their factors, memory-bound), so
#: one in 40 kept a query at 10^6 rows near 50 ms (40,000 each way: recall 0.96, 78 ms); with the rows of largest
#: norm among them (half searched, as many heavy rows), 37 ms at recall 0.975.
ROWS_PER_CANDIDATE = 40


#: Where the index keeps rotated factors, each test sample's candidates are ranked by their rank-``R`` estimate
#: (:meth:`.index_factors.KeptFactors.estimates`) and only this many times TracIn's candidates, largest and smallest,
#: are scored exactly (200 of 2,400 for ``k = 10``).
REFINED_FACTOR = 4
#: ... when a test sample has more candidates than this (both directions): below, scoring them all exactly costs no
#: more (measured on the benchmark's MLP, one thread: 4,800 rows 5.1 ms exactly, 2.4 ms estimated plus 0.6 ms for
#: the test blocks' randomized rank-4 approximation and 0.3 ms for the 400 exact; a whole query at 10^5 rows, the
#: default 2,400 candidates each way, 25 ms against 31 ms scoring all 4,800, the same recall, load average 5).
REFINE_ABOVE = 2_000


def candidate_count(k: int, candidates: int | None, rows: int) -> int:
    """The candidates per test sample and direction in a pass of ``rows`` (where their estimates rank them: half that
    searched, at least 48 ``max(4k, 50)``, and as many rows of largest norm; module docstring): ``candidates``, else
    :data:`PRECONDITIONED_FACTOR` times :func:`~.vector_index.default_candidates` (2,400 for ``k = 10``) or
    ``rows /`` :data:`ROWS_PER_CANDIDATE`, the larger (2,500 of 10^5 rows, 25,000 of 10^6)."""
    return candidates or max(PRECONDITIONED_FACTOR * default_candidates(k), rows // ROWS_PER_CANDIDATE)


def influence(method: str, store: StoreReader, train: Points, test: Points, args: MethodArgs) -> Scores:
    """``method`` (``"kfac"``, ``"ekfac"``, ``"trak"``) scored on each test sample's candidates only (module docstring):
    the top-``args.k`` path of their :class:`~.method_table.Method` entries.

    ``args.index``: ``None`` uses a kept index, ``True`` builds one when missing, ``False`` scores every row; every
    row is scored too where no index is kept (``None``) or the store is partitioned. ``.top(k)`` of the result is
    the exhaustive query's where the candidates hold its top-k.
    """
    layers, test_ids = args.layers, args.test_ids
    if method == "trak":
        ridge = sketches.DEFAULT_REGULARIZATION if args.relative_damping is None else args.relative_damping
        every = sketches.kernel_influence(store, train, test, layers=layers, regularization=ridge)
        count = candidate_count(args.k or 0, args.candidates, len(every.row_ids))
        return strongest(every if test_ids is None else _columns(every, test_ids), count)
    relative = DEFAULT_RELATIVE_DAMPING if args.relative_damping is None else args.relative_damping
    chosen: CurvatureMethod = "kfac" if method == "kfac" else "ekfac"
    options: dict[str, Any] = {"damping": args.damping, "relative_damping": relative, "layers": layers}

    def exhaustive() -> Scores:
        return curvature.kfac_influence(store, train, test, method=chosen, test_ids=test_ids, **options)

    if args.index is False or scan_of(store).partitioned:
        return exhaustive()
    try:
        wanted = (args.k or 0, args.candidates, REFINED_FACTOR * default_candidates(args.k or 0))
        found = _candidates(store, train, test, chosen, args.index, wanted, test_ids, args.max_bytes, options)
    except StoreError as exc:  # a part changed on disk while it was read: this answer scans every row
        warn_line(f"{exc}; every row is scanned", 3)
        return exhaustive()
    if found is None:
        return exhaustive()
    ids, fitted, passes = found
    if projected_only(store, sketch_layers(store, layers)) or all(o.factors and t.blocks for o, t in passes):
        row_parts, col_parts = [], []
        for opened, tested in passes:
            rows = opened.rows_of(ids)  # (n,) every occurrence
            matrix = _exact(opened, tested, rows)  # (n, M)
            row_parts.append((opened.sample_ids[rows], matrix))
            col_parts.append((tested.ids, matrix))
        return queries.summed_scores(row_parts, col_parts)
    pairs = queries.selected_pairs(store, train, test, layers=layers, train_ids=ids, test_ids=test_ids)
    fitted_on = {cp: store.select(cp, layers=layers) for cp, _, _, _ in pairs}
    return curvature.preconditioned_scores(
        store, pairs, fitted_on, chosen, args.damping, relative, args.max_bytes, fitted=fitted
    )


def _exact(opened: WhitenedIndex, tested: QuerySide, rows: np.ndarray) -> np.ndarray:
    """``(n, M)`` the method's scores of these rows without a shard: from the rotated factors, or (every record
    projected on the curvature eigenbasis) the index's vectors, which are then the whitened records."""
    if opened.factors is not None and tested.blocks is not None:
        return opened.factors.scores(rows, opened.lr[rows], tested.blocks)
    assert opened.flat is not None  # projected records are not compressed
    return opened.flat.weighted_rows(rows).astype(np.float64) @ tested.sketches.astype(np.float64).T


Passes = list[tuple[WhitenedIndex, QuerySide]]


def _candidates(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    method: CurvatureMethod,
    index: bool | None,
    wanted: tuple[int, int | None, int],
    test_ids: Sequence[int] | None,
    max_bytes: int,
    options: dict[str, Any],
) -> tuple[list[int], dict[str, Curvature], Passes] | None:
    """``(candidate ids, curvature per train pass, (index, its queries) per pass)``: per pass and test sample the
    :func:`candidate_count` rows (``wanted``: ``(k, candidates, keep)``) of largest and smallest sketched score, of
    which, where the index keeps rotated factors, the ``keep`` largest and smallest by their estimate above
    :data:`REFINE_ABOVE` (:func:`_refined`); ``None`` where
    a pass has no kept index and ``index`` is not ``True``, or its preconditioned index would exceed
    :data:`~.index_preconditioned.MAX_INDEX_BYTES` (every row is then scored)."""
    order = sketch_layers(store, options["layers"])
    found: set[int] = set()
    fitted: dict[str, Curvature] = {}
    passes: Passes = []
    for train_cp, test_cp in queries.paired_points(train, test):
        if index is None and not _kept(store, train_cp, order):
            return None
        opened = kept_index(index_key(store, train_cp, method, options, order, max_bytes))
        if opened is None and not index_fits(store, train_cp, order):
            return None
        if train_cp not in fitted:
            fitted[train_cp] = fitted_curvature(store, train_cp, method, options["layers"], max_bytes)
        if opened is None:
            opened = preconditioned_index(store, train_cp, method, fitted[train_cp], options, order, max_bytes)
        tested = query_side(store, test_cp, test_ids, fitted[train_cp], options, order, opened, max_bytes)
        count = min(candidate_count(wanted[0], wanted[1], len(opened.sample_ids)), len(opened.sample_ids))
        refine = opened.factors is not None and tested.blocks is not None and 2 * count > REFINE_ABOVE
        searched = (
            min(count, max(PRECONDITIONED_FACTOR * default_candidates(wanted[0]), count // 2)) if refine else count
        )
        rows = opened.search(np.concatenate([tested.sketches, -tested.sketches]), searched)  # (2M, c)
        kept = _refined(opened, tested, rows, wanted[2], opened.heaviest(count)) if refine else rows[rows >= 0]
        found.update(opened.sample_ids[kept].tolist())
        passes.append((opened, tested))
    return sorted(found), fitted, passes


def _refined(opened: WhitenedIndex, tested: QuerySide, rows: np.ndarray, keep: int, heavy: np.ndarray) -> np.ndarray:
    """The candidate rows (``rows`` ``(2M, c)``: each test sample's ``+q`` then ``-q`` searches, and the ``heavy``
    rows of every test sample) whose rank-``R`` estimate is among their test sample's ``keep`` largest or smallest;
    all of them where they are no more than ``keep``."""
    assert opened.factors is not None and tested.blocks is not None
    if rows.shape[1] + len(heavy) <= keep:
        return np.union1d(rows[rows >= 0], heavy)
    tests, kept = len(tested.ids), []
    for j, basis in enumerate(low_rank(tested.blocks)):
        held = np.zeros(len(opened.sample_ids), bool)  # a mask, not np.unique: 16 ms for 80,000 rows of 10^6
        held[rows[j][rows[j] >= 0]] = True
        held[rows[tests + j][rows[tests + j] >= 0]] = True
        held[heavy] = True
        mine = np.flatnonzero(held)  # (c',) this test sample's candidates, ascending
        estimate = opened.factors.estimates(mine, opened.lr[mine], basis)[:, None]  # (c', 1)
        count = min(keep, len(mine))
        kept.append(mine[np.union1d(largest(estimate, count)[0], largest(-estimate, count)[0])])
    return np.concatenate(kept) if kept else np.zeros(0, np.int64)


def _kept(store: StoreReader, capture_point: str, order: list[str]) -> bool:
    """Whether the pass's TracIn index is kept on disk (the store was indexed: ``index=None`` goes through one)."""
    key = index_head(capture_point, default_dim(store, capture_point, order), 0, order)[0]
    return vf.read_manifest(store.path, key) is not None


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
