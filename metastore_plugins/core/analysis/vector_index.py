"""Top-k at any scale: a nearest-gradient index over a capture point's sketches, exact where it matters.

``store.influence(train, test, k=10)`` and ``store.similar(query, candidates, k=10)`` ask for a
few rows out of millions. The index answers *which rows could be among them*; the store then
scores only those rows:

1. **Candidates.** Each training row's vector is its per-layer Kronecker sketches side by side
   (``sketches(..., combine="concat")``; for layers kept projected ``k x k``, the stored projections
   themselves), times its batch's learning rate: its inner product with a test sample's vector is
   the sketched TracIn score, and on projected records exactly the estimate ``influence`` reports.
   Per test sample and direction (proponents: ``+t``, opponents: ``-t``) the ``candidates`` rows
   of largest inner product are taken, over every paired pass; their union is rescored.
2. **Estimated scores.** :func:`~metastore_plugins.core.analysis.queries.influence` on the union only
   (exact for layers kept as factors); where every record of the layers is projected, the same
   estimates from the index's vectors, without reading a shard.
3. **Exact scores.** Given a ``recompute`` function, the existing refinement
   (:func:`~metastore_plugins.core.analysis.refine.refine_influence`) recomputes the strongest rows.

The result is a :class:`Scores` whose rows are the union of the candidates: ``.top(k)`` is the
answer. The search structure is chosen from the rows ``N`` and width ``D``
(:func:`.vector_search.choose_plan`): an exhaustive scan of the vectors (flat) up to
:data:`.vector_search.FLAT_MAX_VALUES` numbers, FAISS IVF above (``faiss-cpu``, the ``index`` extra;
:func:`.vector_search.build_ivf`). Without FAISS every index is flat: the same candidates, slower. ``similar``
always scans its vectors (cosine is not the inner product IVF is built for).

The index in memory and its search are :mod:`.vector_search` (its names are imported from there), its files
:mod:`.index_files`; this module holds the queries through it (and names :mod:`.index_files`' public names).

**Files** (``<store>/vector_index/``, :mod:`metastore_plugins.core.store.vectors.vector_files`): one part per
shard holding batches of the capture point (its vectors, sample ids and learning rates), bound to
the shard's file name and sha256 from the store's index; the FAISS index bound to the parts it
was built over; a CRC'd manifest listing both with their sha256. A shard that changed or went away
makes its part stale: it is rebuilt from the shard (new shards get new parts). A part or FAISS file
that does not match its sha256, a damaged manifest, a link where a file or the folder belongs: not
used, said in one warning line, rebuilt (in memory where the store cannot be written).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metastore_plugins.core.analysis import queries
from metastore_plugins.core.analysis.index_files import (
    DEFAULT_DIM,
    build_vector_index,
    default_dim,
    open_index,
    warn_line,
)
from metastore_plugins.core.analysis.method_table import MethodArgs, Points
from metastore_plugins.core.analysis.refine import refine_influence
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import scan_of
from metastore_plugins.core.analysis.sketches import compute_sketches, sketch_layers
from metastore_plugins.core.analysis.vector_search import VectorIndex, largest
from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.records import KIND_CODES
from metastore_plugins.core.store import StoreReader

__all__ = [
    "DEFAULT_DIM",
    "build_vector_index",
    "default_candidates",
    "default_dim",
    "index_scores",
    "influence",
    "open_index",
    "projected_only",
    "similar",
]


def _test_sketches(
    store: StoreReader,
    capture_point: str,
    ids: Sequence[int] | None,
    index: VectorIndex,
    layers: Sequence[str],
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(sample ids (M,), sketches (M, D))`` of the query side, laid out as the index's vectors."""
    selection = store.select(capture_point, sample_ids=ids, layers=list(layers))
    found, sketch = compute_sketches(selection, list(layers), index.dim, seed, "concat", DEFAULT_MAX_BYTES)
    return found, sketch.numpy()


def projected_only(store: StoreReader, layers: Sequence[str]) -> bool:
    """Whether every stored record of these layers is ``projected``: then the index's vectors are the records."""
    record, wanted = store.index.record, set(layers)
    codes = [i for i, name in enumerate(store.index.layer_names) if name in wanted]
    mine = np.isin(record["layer"], codes)  # (R,) by layer code: no string per record
    return bool(mine.any()) and bool(np.all(record["kind"][mine] == KIND_CODES.index("projected")))


def influence(store: StoreReader, train: Points, test: Points, args: MethodArgs) -> Scores:
    """:func:`~metastore_plugins.core.analysis.queries.influence`; with ``k``, through the nearest-gradient index.

    ``args.k``: the rows ``.top(k)`` will show; the index then gives each test sample's ``candidates``
    (default :func:`default_candidates`) proponent and opponent candidates per pass, and only their union is
    scored (the result's rows): from the index's vectors where every record of the layers is
    projected (they are those records: the same estimates), from the shards otherwise. ``index``:
    ``None`` uses a kept index (brought up to date), ``True`` builds one when missing, ``False``
    scans every row. ``recompute``: exact refinement of the estimates
    (:func:`~metastore_plugins.core.analysis.refine.refine_influence`). ``train_ids`` scans every row. Partitioned
    (a distributed store): each rank searches the index of its own shards, and the ranks' pooled candidates
    are scored partitioned; every row where a rank has none kept.
    """
    scan = scan_of(store)
    if scan.partitioned and args.recompute is not None:
        raise ConfigError("recompute= is not supported by partitioned queries; refine the result with refine_influence")
    if args.k is None or args.index is False or args.train_ids is not None:
        return _every_row(store, train, test, args)
    try:
        scores = _influence(store, train, test, args, args.k)
    except StoreError as exc:  # a part changed on disk while it was read: this answer scans every row
        if scan.partitioned:
            raise
        warn_line(f"{exc}; every row is scanned", 3)
        scores = _every_row(store, train, test, args)
    if args.recompute is not None:
        return refine_influence(store, scores, train, test, args.recompute)
    return scores


def _every_row(
    store: StoreReader, train: Points, test: Points, args: MethodArgs, train_ids: Sequence[int] | None = None
) -> Scores:
    """TracIn (:func:`.queries.influence`) of ``train_ids`` (default: ``args.train_ids``, every row where ``None``)."""
    chosen = args.train_ids if train_ids is None else train_ids
    return queries.influence(
        store, train, test, layers=args.layers, train_ids=chosen, test_ids=args.test_ids, max_bytes=args.max_bytes
    )


def _influence(store: StoreReader, train: Points, test: Points, args: MethodArgs, k: int) -> Scores:
    """:func:`influence` through the index (``k`` given); :class:`StoreError` when a part changed while read."""
    scan = scan_of(store)
    count = args.candidates or default_candidates(k)
    order = sketch_layers(store, args.layers)
    found: set[int] = set()
    passes: Passes = []
    for train_cp, test_cp in queries.paired_points(train, test):
        build, partitioned = bool(args.index), scan.partitioned
        opened = open_index(
            store, train_cp, layers=order, build=build, max_bytes=args.max_bytes, partitioned=partitioned
        )
        if not all(scan.every(opened is not None, "vector index: kept")) or opened is None:  # every rank agrees
            return _every_row(store, train, test, args)
        tested, sketch = _test_sketches(store, test_cp, args.test_ids, opened, order, 0)  # (M,), (M, D)
        rows = opened.search(np.concatenate([sketch, -sketch]), count)
        found.update(opened.sample_ids[rows[rows >= 0]].tolist())
        passes.append((opened, tested, sketch))
    if scan.partitioned:  # each rank's candidates from the index of its shards: their union, scored partitioned
        found = set().union(*scan.every(sorted(found), "vector index: candidates"))
    if projected_only(store, order) and not scan.partitioned:
        return index_scores(passes, sorted(found))
    return _every_row(store, train, test, args, sorted(found))


#: per pass: its index, the test side's sample ids ``(M,)`` and query vectors ``(M, D)``, laid out as its rows
Passes = list[tuple[VectorIndex, np.ndarray, np.ndarray]]


def index_scores(passes: Passes, ids: Sequence[int]) -> Scores:
    """``sum_c <lr_i v_i, q_j>`` of the rows ``ids`` from each pass's index vectors: where every record of the
    layers is projected (the vectors are those records), the query's own scores without reading a shard."""
    row_parts, col_parts = [], []
    for opened, tested, query in passes:
        rows = np.flatnonzero(np.isin(opened.sample_ids, ids))  # (n,) every occurrence
        matrix = opened.weighted_rows(rows).astype(np.float64) @ query.astype(np.float64).T  # (n, M)
        row_parts.append((opened.sample_ids[rows], matrix))
        col_parts.append((tested, matrix))
    return queries.summed_scores(row_parts, col_parts)


def default_candidates(k: int) -> int:
    """The candidates searched per test sample and direction for top-``k`` when none are asked: ``max(4 k, 50)``."""
    return max(4 * k, 50)


def similar(
    store: StoreReader,
    query: str,
    candidates: str,
    *,
    k: int | None = None,
    index: bool | None = None,
    count: int | None = None,
    query_ids: Sequence[int] | None = None,
    cosine: bool = True,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Scores:
    """:func:`~metastore_plugins.core.analysis.queries.similar`; with ``k``, only the ``count`` (default
    :func:`default_candidates`) most and least similar candidates per query by sketch (cosine, or inner product) are
    scored: a scan of the index's vectors, not of the shards."""

    def scan(found: Sequence[int] | None) -> Scores:
        return queries.similar(
            store,
            query,
            candidates,
            query_ids=query_ids,
            cosine=cosine,
            layers=layers,
            max_bytes=max_bytes,
            candidate_ids=found,
        )

    if k is None or index is False or scan_of(store).partitioned:
        return scan(None)
    try:
        return scan(
            _similar_candidates(store, query, candidates, k, index, count, query_ids, cosine, layers, max_bytes)
        )
    except StoreError as exc:  # a part changed on disk while it was read: this answer scans every row
        warn_line(f"{exc}; every row is scanned", 3)
        return scan(None)


def _similar_candidates(
    store: StoreReader,
    query: str,
    candidates: str,
    k: int,
    index: bool | None,
    count: int | None,
    query_ids: Sequence[int] | None,
    cosine: bool,
    layers: Sequence[str] | None,
    max_bytes: int,
) -> list[int] | None:
    """The candidate ids :func:`similar` scores (None: every row); :class:`StoreError` when a part changed."""
    order = sketch_layers(store, layers)
    opened = open_index(store, candidates, layers=order, build=bool(index), max_bytes=max_bytes)
    if opened is None:
        return None
    sketch = _test_sketches(store, query, query_ids, opened, order, 0)[1]  # (M, D)
    wanted = count or default_candidates(k)
    both = np.concatenate([sketch, -sketch])  # the most similar, and the least (what .top calls opponents)
    if cosine:
        rows = opened.search_cosine(both, wanted)
    else:
        rows = largest(opened.vectors @ both.T, min(wanted, len(opened.sample_ids)))
    return sorted(set(opened.sample_ids[rows.ravel()].tolist()))
