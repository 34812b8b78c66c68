"""Partitioned queries: the train side split across ranks by shard, the test side broadcast, results gathered.

Each function is the query of :mod:`metastore_plugins.core.analysis` of the same name, run by
every rank of a process group at once (call it on every rank, with the same arguments):

- the train side (rows: the samples scored) is split by shard, balanced by rows
  (:mod:`~metastore_plugins.core.distributed.partition`); each rank reads only its shards
  and runs the single-process code (``queries.lr_sq_norms``, ``queries.dot_blocks``,
  ``sketches.compute_sketches``) on its share;
- the test side (the query gradients) is read by rank 0, chunk by chunk, and broadcast;
- per-rank blocks are gathered and put back in selection order: every rank gets the full
  result (``dst=None``), or only rank ``dst`` does (others get ``None``); rankings
  (:func:`partitioned_influence_top`) all-gather each rank's top-k instead of its scores.

Results equal the single-process query's, in the same order. ``influence``, ``similar``
with ``cosine=False`` and the sketches are computed by the same op calls on the same blocks
(bitwise identical on one device). Norms and self-influence group consecutive batches per
op call (``Selection.merged``) and a rank's groups differ from one process's: they agree to
float rounding (relative 1e-6 in float32). Without a process group they run in this process.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import queries
from metastore_plugins.core.analysis.per_batch import positive_int
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.sketches import check_seed, compute_sketches, sketch_key, sketch_layers
from metastore_plugins.core.distributed.collectives import Comm
from metastore_plugins.core.distributed.partition import Part, Share, place, split
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import Selection, StoreReader, sketch_cache

Device = torch.device | str | None


def _setup(group: Any, device: Device) -> tuple[Comm, Device]:
    """The communicator, and the device to compute on: ``device``, else the local GPU under NCCL, else the CPU."""
    comm = Comm.of(group)
    return comm, device if device is not None else (comm.device if comm.device.type != "cpu" else None)


def _collect(comm: Comm, block: np.ndarray, parts: list[Part], what: str, dst: int | None) -> np.ndarray | None:
    """Every rank's ``(n_r, ...)`` block put back in selection order, on every rank (``dst=None``) or on ``dst``."""
    total, positions = parts[0].total, [p.positions for p in parts]
    if dst is None:
        return place(comm.all_gather_rows(block, what), positions, total)
    gathered = comm.gather_rows(block, what, dst)
    return None if gathered is None else place(gathered, positions, total)


def _mine(store: StoreReader, comm: Comm, parts: list[Part], what: str) -> Part:
    """This rank's part; a store that keeps a ledger (``DistributedStore.shares``) notes the rows it scores."""
    part = parts[comm.rank]
    ledger = getattr(store, "shares", None)
    if isinstance(ledger, list):
        ledger.append(Share(what, len(part.positions), part.total))
    return part


def _portable(records: list[LayerRecord]) -> list[LayerRecord]:
    """Records whose tensors own just their bytes (a view would send its whole shard when pickled)."""
    return [replace(r, tensors={k: v.clone() for k, v in r.tensors.items()}) for r in records]


def broadcast_columns(comm: Comm, cols: Selection, max_bytes: int, what: str) -> Iterator[list[queries.ColumnBatch]]:
    """The column batches, chunk by chunk (``max_bytes / 2`` of records each): read by rank 0, broadcast to all."""
    source = iter(cols.chunks(max_bytes // 2)) if comm.rank == 0 else None
    while True:
        chunk: list[queries.ColumnBatch] | None = None
        if source is not None:
            found = next(source, None)
            chunk = (
                None
                if found is None
                else [(b.size, b.records if comm.world == 1 else _portable(b.records)) for b in found]
            )
        chunk = comm.broadcast(chunk, what)
        if chunk is None:  # rank 0 has read every chunk
            return
        yield chunk


def partitioned_self_influence(
    store: StoreReader,
    capture_points: str | Sequence[str] | None = None,
    *,
    group: Any = None,
    device: Device = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    **where: Any,
) -> np.ndarray:
    """:func:`~metastore_plugins.core.analysis.queries.self_influence` (``sum_c lr_c ||g_i(w_c)||^2``) on every rank.

    Aligned as the single-process result: ``sample_ids(cp, **where)`` for one capture point,
    ``self_influence_ids(points)`` for several. Equal to it to float rounding.
    """
    comm, device = _setup(group, device)
    points = [capture_points] if capture_points is None or isinstance(capture_points, str) else list(capture_points)
    results = []
    for point in points:
        selection = store.select(point, **where)
        parts = split(selection, comm.world)
        mine = _mine(store, comm, parts, f"self_influence of {point!r}")
        local = queries.lr_sq_norms(mine.selection, max_bytes, device)  # (n_r,)
        values = _collect(comm, local, parts, f"self_influence of {point!r}", None)
        results.append((selection.sample_ids(), values if values is not None else np.zeros(0)))
    return queries.summed_by_id(results)


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
    comm, device = _setup(group, device)
    selection = store.select(capture_point, **where)
    parts = split(selection, comm.world)
    mine = _mine(store, comm, parts, f"norms of {capture_point!r}")
    local = queries.sq_norms(mine.selection, by_layer, max_bytes, device)  # {key: (n_r,)}
    keys = list(dict.fromkeys(k for ks in comm.all_gather_objects(list(local), "norms (keys)") for k in ks))
    roots = {}
    for key in keys:
        block = local.get(key, np.zeros(len(mine.positions)))  # a rank without the key: 0, as in one process
        full = _collect(comm, block, parts, f"norms ({key})", None)
        roots[key] = np.sqrt(np.clip(full if full is not None else np.zeros(0), 0, None))
    return roots if by_layer else roots.get("total", np.zeros(0))


def partitioned_influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    group: Any = None,
    device: Device = None,
    dst: int | None = None,
) -> Scores | None:
    """:func:`~metastore_plugins.core.analysis.queries.influence` (TracIn ``sum_c lr_c <g_i, g_j>``), gathered.

    The ``(N, M)`` matrix is all-gathered (``dst=None``: every rank returns it) or gathered on
    rank ``dst`` (other ranks return ``None``). For rankings only, :func:`partitioned_influence_top`
    sends ``k`` scores per rank and column instead.
    """
    comm, device = _setup(group, device)
    row_parts, col_parts = [], []
    for train_cp, test_cp in queries.paired_points(train, test):
        rows = store.select(train_cp, sample_ids=train_ids, layers=layers)
        cols = store.select(test_cp, sample_ids=test_ids, layers=layers)
        parts = split(rows, comm.world)
        columns = broadcast_columns(comm, cols, max_bytes, f"influence: test gradients of {test_cp!r}")
        mine = _mine(store, comm, parts, f"influence of {train_cp!r}").selection
        local = queries.dot_blocks(mine, columns, weighted=True, device=device)  # (n_r, M)
        full = _collect(comm, local, parts, f"influence: scores of {train_cp!r}", dst)  # (N, M)
        if full is not None:
            row_parts.append((rows.sample_ids(), full))
            col_parts.append((cols.sample_ids(), full))
    return queries.summed_scores(row_parts, col_parts) if row_parts else None


def partitioned_similar(
    store: StoreReader,
    query: str,
    candidates: str,
    *,
    query_ids: Sequence[int] | None = None,
    cosine: bool = True,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    group: Any = None,
    device: Device = None,
    dst: int | None = None,
) -> Scores | None:
    """:func:`~metastore_plugins.core.analysis.queries.similar`: candidates partitioned, query gradients broadcast.

    Cosine divides by ``||g_i|| ||g_j||``: the candidates' norms are computed by their rank,
    the queries' by rank 0 and broadcast.
    """
    comm, device = _setup(group, device)
    rows = store.select(candidates, layers=layers)
    cols = store.select(query, sample_ids=query_ids, layers=layers)
    parts = split(rows, comm.world)
    mine = _mine(store, comm, parts, f"similar in {candidates!r}").selection
    local = queries.dot_blocks(
        mine, broadcast_columns(comm, cols, max_bytes, "similar: query gradients"), device=device
    )
    if cosine:
        row_sq = queries.sq_norms(mine, device=device).get("total", np.zeros(0))  # (n_r,)
        col_sq = comm.broadcast(queries.sq_norms(cols)["total"] if comm.rank == 0 else None, "similar: query norms")
        local = ops.cosine(torch.from_numpy(local), torch.from_numpy(row_sq), torch.from_numpy(col_sq)).numpy()
    full = _collect(comm, local, parts, "similar: scores", dst)  # (N, M)
    return None if full is None else Scores(full, rows.sample_ids(), cols.sample_ids())


def partitioned_sketches(
    store: StoreReader,
    capture_point: str,
    dim: int = 64,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    *,
    cache: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    group: Any = None,
    device: Device = None,
) -> np.ndarray:
    """Summed Kronecker sketches ``(N, dim^2)`` of a capture point, built partitioned, on every rank.

    Aligned with ``sample_ids(capture_point)``; the same as ``sketches(capture_point, dim, seed,
    layers, cache=False)``. With ``cache``, rank 0 reads the store's sketch cache first (and
    broadcasts it when sound), or writes it once the sketches are gathered.
    """
    comm, device = _setup(group, device)
    dim, seed, order = positive_int("dim", dim), check_seed(seed), sketch_layers(store, layers)
    key = sketch_key(store, capture_point, dim, seed, order) if cache else None
    found = sketch_cache.load(store.path, key) if key is not None and comm.rank == 0 else None
    kept = comm.broadcast(None if found is None else found[1].numpy(), "sketches: the cached sketches")
    if kept is not None:
        return np.asarray(kept, dtype=np.float64)
    selection = store.select(capture_point, layers=order)
    parts = split(selection, comm.world)
    mine = _mine(store, comm, parts, f"sketches of {capture_point!r}").selection
    _, local = compute_sketches(mine, order, dim, seed, "sum", max_bytes, device)  # (n_r, k)
    full = _collect(comm, local.numpy(), parts, f"sketches of {capture_point!r}", None)  # (N, k) float32
    summed = full if full is not None else np.zeros((0, dim * dim), np.float32)
    if key is not None and comm.rank == 0:
        sketch_cache.save(store.path, key, selection.sample_ids(), torch.from_numpy(summed))
    return summed.astype(np.float64)


def partitioned_influence_top(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    k: int = 10,
    *,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    group: Any = None,
    device: Device = None,
) -> list[dict[str, Any]]:
    """``influence(...).top(k)`` on every rank, without gathering the score matrix.

    Each rank sums its rows over the paired capture points and all-gathers, per test sample,
    its ``k`` largest and smallest scores. A sample id whose occurrences lie on several ranks
    (its shards of two checkpoint passes went to different ranks) has only partial sums on
    each: those rows are all-gathered and summed first. Same rows as ``Scores.top(k)``;
    scores equal to float rounding (exactly for ids held by one rank).
    """
    comm, device = _setup(group, device)
    k = positive_int("k", k)
    mine_rows, col_parts, ids_owners = [], [], []
    for train_cp, test_cp in queries.paired_points(train, test):
        rows = store.select(train_cp, sample_ids=train_ids, layers=layers)
        cols = store.select(test_cp, sample_ids=test_ids, layers=layers)
        parts = split(rows, comm.world)
        columns = broadcast_columns(comm, cols, max_bytes, f"influence: test gradients of {test_cp!r}")
        mine = _mine(store, comm, parts, f"influence of {train_cp!r}")
        local = queries.dot_blocks(mine.selection, columns, weighted=True, device=device)  # (n_r, M)
        ids = rows.sample_ids()
        owners = np.zeros(len(ids), np.int64)
        for rank, part in enumerate(parts):
            owners[part.positions] = rank
        mine_rows.append((ids[mine.positions], local))
        col_parts.append((cols.sample_ids(), local))
        ids_owners.append(np.stack([ids, owners], 1))  # (N_c, 2)
    with warnings.catch_warnings():  # a rank's share of several capture points holds different samples
        warnings.simplefilter("ignore")
        summed = queries.summed_scores(mine_rows, col_parts)  # (u_r, M)
    pairs = np.unique(np.concatenate(ids_owners), axis=0)  # (id, owner) pairs
    unique, counts = np.unique(pairs[:, 0], return_counts=True)
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
