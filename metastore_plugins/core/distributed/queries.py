"""The queries of :mod:`metastore_plugins.core.analysis` over a :class:`~.scan.PartitionedScan`, as functions.

Each ``partitioned_<query>`` is the analysis query of that name read through a partitioned scan of
``group`` (call it on every rank, with the same arguments): the rows (the samples scored) are split
by shard, balanced by rows (:mod:`~metastore_plugins.core.distributed.partition`); the column side
(the query gradients) is read by rank 0, chunk by chunk, and broadcast; per-rank blocks are
gathered and put back in selection order: every rank gets the full result (``dst=None``), or only
rank ``dst`` does (others get ``None``). :func:`partitioned_influence_top` all-gathers each rank's
top-k instead of its scores. A :class:`~.store.DistributedStore` runs every query this way.

Results equal the single-process query's, in the same order. The sketches are computed by the
same op calls on the same blocks (bitwise identical on one device). Influence, similarity, norms
and self-influence group consecutive batches per op call (``Selection.merged``) and a rank's
groups differ from one process's: they agree to float rounding (relative 1e-6 in float32). Without a
process group they run in this process.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import queries
from metastore_plugins.core.analysis import sketches as sketch_queries
from metastore_plugins.core.analysis.per_batch import positive_int
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import Device
from metastore_plugins.core.distributed.scan import PartitionedScan
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import StoreReader


def _scan(store: StoreReader, group: Any, device: Device) -> PartitionedScan:
    """A partitioned scan of ``group``; it notes its reads in the store's ledger (``DistributedStore.shares``)."""
    ledger = getattr(store, "shares", None)
    return PartitionedScan(group, device, ledger if isinstance(ledger, list) else None)


def partitioned_self_influence(
    store: StoreReader,
    capture_points: str | Sequence[str] | None = None,
    *,
    group: Any = None,
    device: Device = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    **where: Any,
) -> np.ndarray:
    """:func:`~metastore_plugins.core.analysis.queries.self_influence` (``sum_c lr_c ||g_i(w_c)||^2``) on every rank."""
    scan = _scan(store, group, device)
    return queries.self_influence(store, capture_points, max_bytes=max_bytes, scan=scan, **where)


def partitioned_norms(
    store: StoreReader,
    capture_point: str | None = None,
    *,
    by_layer: bool = False,
    group: Any = None,
    device: Device = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    **where: Any,
) -> Any:
    """:func:`~metastore_plugins.core.analysis.queries.norms` (``||g_i||``, or ``{layer: (N,)}``) on every rank."""
    scan = _scan(store, group, device)
    return queries.norms(store, capture_point, by_layer=by_layer, max_bytes=max_bytes, scan=scan, **where)


def partitioned_influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    group: Any = None,
    device: Device = None,
    dst: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    **select: Any,
) -> Scores | None:
    """:func:`~metastore_plugins.core.analysis.queries.influence` (TracIn ``sum_c lr_c <g_i, g_j>``), gathered.

    ``select``: its ``layers``, ``train_ids`` and ``test_ids``. The ``(N, M)`` matrix is all-gathered
    (``dst=None``: every rank returns it) or gathered on rank ``dst`` (other ranks return ``None``).
    For rankings only, :func:`partitioned_influence_top` sends ``k`` scores per rank and column instead.
    """
    pairs = queries.selected_pairs(store, train, test, **select)
    return queries.scored_pairs(store, pairs, max_bytes=max_bytes, scan=_scan(store, group, device), dst=dst)


def partitioned_similar(
    store: StoreReader, query: str, candidates: str, *, group: Any = None, device: Device = None, **options: Any
) -> Scores | None:
    """:func:`~metastore_plugins.core.analysis.queries.similar`: candidates partitioned, query gradients broadcast.

    ``options``: its ``query_ids``, ``layers``, ``cosine`` and ``max_bytes``, and ``dst`` as
    :func:`partitioned_influence` takes it.
    """
    layers, query_ids = options.pop("layers", None), options.pop("query_ids", None)
    rows, cols = store.select(candidates, layers=layers), store.select(query, sample_ids=query_ids, layers=layers)
    return queries.scored_similar(store, rows, cols, candidates, scan=_scan(store, group, device), **options)


def partitioned_sketches(
    store: StoreReader,
    capture_point: str,
    dim: int = 64,
    *args: Any,
    group: Any = None,
    device: Device = None,
    **options: Any,
) -> np.ndarray:
    """Summed Kronecker sketches ``(N, dim^2)`` of a capture point, built partitioned, on every rank.

    ``args``, ``options``: ``seed``, ``layers``, ``cache``, ``max_bytes`` of
    :func:`~metastore_plugins.core.analysis.sketches.sketches`, the same as its ``cache=False`` result.
    With ``cache`` (the default), rank 0 reads the store's sketch cache first (and broadcasts it
    when sound), or writes it once the sketches are gathered.
    """
    scan = _scan(store, group, device)
    return sketch_queries.sketches(store, capture_point, dim, *args, scan=scan, **options)


def partitioned_influence_top(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    k: int = 10,
    *,
    group: Any = None,
    device: Device = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    **select: Any,
) -> list[dict[str, Any]]:
    """``influence(...).top(k)`` on every rank, without gathering the score matrix.

    Each rank sums its rows over the paired capture points and all-gathers, per test sample,
    its ``k`` largest and smallest scores. A sample id whose occurrences lie on several ranks
    (its shards of two checkpoint passes went to different ranks) has only partial sums on
    each: those rows are all-gathered and summed first. Same rows as ``Scores.top(k)``;
    scores equal to float rounding (exactly for ids held by one rank). ``select``: as
    :func:`partitioned_influence` takes it.
    """
    scan, k = _scan(store, group, device), positive_int("k", k)
    pairs = queries.selected_pairs(store, train, test, **select)
    mine_rows, col_parts, ids_owners = [], [], []
    for (_, rows, _, _), (part, cols, local) in zip(pairs, queries.pair_blocks(pairs, None, max_bytes, scan)):
        ids = rows.sample_ids()
        owners = part.owners if part.owners is not None else np.zeros(len(ids), np.int64)
        mine_rows.append((ids[part.positions], local))  # (n_r, M)
        col_parts.append((cols.sample_ids(), local))
        ids_owners.append(np.stack([ids, owners], 1))  # (N_c, 2)
    with warnings.catch_warnings():  # a rank's share of several capture points holds different samples
        warnings.simplefilter("ignore")
        summed = queries.summed_scores(mine_rows, col_parts)  # (u_r, M)
    comm = scan.comm
    held = np.unique(np.concatenate(ids_owners), axis=0)  # (id, owner) pairs
    unique, counts = np.unique(held[:, 0], return_counts=True)
    shared = np.isin(summed.row_ids, unique[counts > 1])  # (u_r,) rows with only a partial sum here
    whole = summed.scores[~shared]  # (w_r, M)
    ranked = ops.topk(torch.from_numpy(whole), k, dim=0)
    whole_ids = summed.row_ids[~shared]
    tops = comm.all_gather_objects(
        (
            whole_ids[ranked.proponents.numpy()],
            ranked.proponent_scores.numpy(),
            whole_ids[ranked.opponents.numpy()],
            ranked.opponent_scores.numpy(),
        ),
        "influence top-k",
    )
    part_ids = comm.all_gather_rows(summed.row_ids[shared], "influence: ids of partial rows")
    partial = comm.all_gather_rows(summed.scores[shared], "influence: partial rows")
    shared_ids, at = np.unique(np.concatenate(part_ids), return_inverse=True)
    shared_rows = np.zeros((len(shared_ids), len(summed.col_ids)))  # (s, M)
    np.add.at(shared_rows, at, np.concatenate(partial) if partial else np.zeros((0, len(summed.col_ids))))
    out = []
    for j, col in enumerate(summed.col_ids.tolist()):
        entry: dict[str, Any] = {"sample_id": col}
        for name, index, largest in (("proponents", 0, True), ("opponents", 2, False)):
            ids = np.concatenate([t[index][j] for t in tops] + [shared_ids])
            scores = np.concatenate([t[index + 1][j] for t in tops] + [shared_rows[:, j]])
            order = np.lexsort((ids, -scores if largest else scores))[:k]
            entry[name] = [(int(ids[i]), float(scores[i])) for i in order]
        out.append(entry)
    return out
