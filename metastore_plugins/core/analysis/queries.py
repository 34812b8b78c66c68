"""Norm, influence and similarity queries: the ops of :mod:`metastore_plugins.core.ops` streamed over selections.

Every function takes a :class:`~metastore_plugins.core.store.StoreReader` first and is also a
method of :class:`~metastore_plugins.core.analysis.GradientStore` (``store.influence(...)``).
Every per-sample result is aligned with ``store.sample_ids(capture_point, ...)`` for the
same arguments. Memory stays within ``max_bytes`` of records (plus the result matrix).
Each reads its selections through the store's scan (:mod:`.scan`): here, or partitioned by shard.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import ColumnBatch, Part, Scan, chunked, scan_of
from metastore_plugins.core.errors import ConfigError, StateError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import Selection, StoredBatch, StoreReader


def on_device(records: list[LayerRecord], device: torch.device | str | None) -> list[LayerRecord]:
    """The records with their tensors on ``device`` (unchanged when ``None``)."""
    if device is None:
        return records
    return [replace(r, tensors={key: value.to(device) for key, value in r.tensors.items()}) for r in records]


def _sq_norms(records: list[LayerRecord], by_layer: bool) -> dict[str, Tensor]:
    if not by_layer:
        return {"total": ops.total_sq_norms(records)}
    layers: dict[str, list] = {}
    for record in records:
        layers.setdefault(record.layer, []).append(record)
    return {layer: ops.total_sq_norms(records) for layer, records in layers.items()}


def sq_norms(
    selection: Selection,
    by_layer: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    device: torch.device | str | None = None,
) -> dict[str, np.ndarray]:
    """Squared per-sample gradient norms (key ``"total"``, or one key per layer), in selection order.

    Samples of batches that hold no records (kept as ``"nothing"`` by a capture policy) get NaN.

    Consecutive batches with the same records go through each op together (:meth:`Selection.merged`),
    on ``device`` when given (the records are read on the CPU).
    """
    parts: list[tuple[int, dict[str, Tensor]]] = []
    for run, records in selection.merged(max_bytes // 2):
        size = sum(b.size for b in run)  # a batch kept as "nothing" (capture policy) has no norms: NaN
        found = _sq_norms(on_device(records, device), by_layer) if records else {"total": torch.full((size,), np.nan)}
        parts.append((size, found))
    keys = list(dict.fromkeys(key for _, part in parts for key in part))
    return {
        key: np.concatenate([p[key].double().cpu().numpy() if key in p else np.zeros(n) for n, p in parts])
        if parts
        else np.zeros(0)
        for key in keys
    }


def dot_matrix(
    rows: Selection,
    cols: Selection,
    weighted: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    device: torch.device | str | None = None,
) -> np.ndarray:
    """``(N, M)`` gradient inner products between two selections (times each row batch's lr if ``weighted``)."""
    return dot_blocks(rows, chunked(cols, max_bytes), weighted, device, max_bytes)


def dot_blocks(
    rows: Selection,
    col_chunks: Iterable[Sequence[ColumnBatch]],
    weighted: bool = False,
    device: torch.device | str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> np.ndarray:
    """:func:`dot_matrix` against column batches given chunk by chunk (read here, or received from another process).

    Row batches are read once per column chunk. Consecutive row batches with the same records are
    joined (:func:`_row_runs`: at most ``max_bytes / 4`` of records read, and as much again for
    their joined copy; the columns take the other half): each ``(row run, column batch)`` block
    is one :func:`~metastore_plugins.core.ops.total_dots` call, so the products are as large as the
    budget allows. A row's scores depend on the other rows of its run only through float rounding.
    """
    col_parts = []
    with rows.read_ahead():  # the rows' first shards read while the first columns are
        for col_chunk in col_chunks:
            chunk = [(size, on_device(records, device)) for size, records in col_chunk]
            row_parts = []
            for run, records in _row_runs(rows, max_bytes):
                records = on_device(records, device)
                block = torch.cat([ops.total_dots(records, c) for _, c in chunk], 1)  # (n, m_c)
                row_parts.append((_lr_weighted(block, run) if weighted else block).cpu())
            col_parts.append(torch.cat(row_parts, 0) if row_parts else torch.zeros(0, sum(n for n, _ in chunk)))
    if not col_parts:
        return np.zeros((len(rows), 0))
    return torch.cat(col_parts, 1).double().numpy()


def _row_runs(rows: Selection, max_bytes: int) -> Iterator[tuple[list[StoredBatch], list[LayerRecord]]]:
    """The row runs of :func:`dot_blocks`: the first batch alone, then :meth:`Selection.merged` runs of
    ``max_bytes / 4``. The first products wait only for the first batch's shard (a process's first
    query reads the next shards meanwhile), not for every shard of a run."""
    first, rest = replace(rows, batch_rows=rows.batch_rows[:1]), replace(rows, batch_rows=rows.batch_rows[1:])
    for part in (first, rest):
        yield from part.merged(max_bytes // 4)


def _lr_weighted(block: Tensor, run: Sequence[StoredBatch]) -> Tensor:
    """``(n, m)`` rows of a run's batches times each batch's lr (one product per element, as batch by batch)."""
    factors = [b.ref.lr_weight for b in run]
    if len(set(factors)) == 1:
        return block * factors[0]
    per_row = torch.tensor(np.repeat(factors, [b.size for b in run]), dtype=block.dtype, device=block.device)  # (n,)
    return block * per_row[:, None]


def _union(id_lists: Sequence[np.ndarray], what: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Sample ids seen in any list (first-seen order) and, per list, the position of each entry in them."""
    every = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in id_lists]) if id_lists else np.zeros(0, np.int64)
    unique, first = np.unique(every, return_index=True)  # (U,) sorted, and where each is first seen
    order = np.argsort(first)  # (U,) the union in first-seen order
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))  # (U,) position in the union of each sorted id
    if len(id_lists) > 1 and any(len(np.unique(ids)) != len(unique) for ids in id_lists):
        warnings.warn(
            f"the {what} capture points hold different samples; each sample's score sums the capture points "
            "it appears in",
            stacklevel=3,
        )
    positions = [rank[np.searchsorted(unique, np.asarray(ids, dtype=np.int64))] for ids in id_lists]
    return unique[order], [p.astype(np.int64) for p in positions]


def paired_points(train: str | Sequence[str], test: str | Sequence[str]) -> list[tuple[str, str]]:
    """Train and test capture points paired one to one (a single name is a list of one)."""
    trains = [train] if isinstance(train, str) else list(train)
    tests = [test] if isinstance(test, str) else list(test)
    if len(trains) != len(tests) or not trains:
        raise ConfigError(f"pair train and test capture points one to one; got {trains} and {tests}")
    return list(zip(trains, tests))


def summed_scores(
    row_parts: Sequence[tuple[np.ndarray, np.ndarray]], col_parts: Sequence[tuple[np.ndarray, np.ndarray]]
) -> Scores:
    """Sum score matrices ``(ids_rows_c, ids_cols_c, matrix_c)`` into one matrix over unique ids."""
    row_ids, row_pos = _union([ids for ids, _ in row_parts], "train")
    col_ids, col_pos = _union([ids for ids, _ in col_parts], "test")
    total = np.zeros((len(row_ids), len(col_ids)))
    for (_, matrix), r, c in zip(row_parts, row_pos, col_pos):
        np.add.at(total, (r[:, None], c[None, :]), matrix)
    return Scores(total, row_ids, col_ids)


def norms(
    store: StoreReader,
    capture_point: str | None = None,
    *,
    by_layer: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    **where: Any,
) -> Any:
    """Per-sample gradient norms ``||g_i||`` (whole model, or ``{layer: (N,)}`` with ``by_layer``).

    ``scan``: how the selection is read (the store's :attr:`scan` by default), as for every query here.
    """
    scan = scan or scan_of(store)
    part = scan.part(store.select(capture_point, **where), f"norms of {capture_point!r}")
    local = sq_norms(part.selection, by_layer, max_bytes, scan.device)  # {key: (n,)}
    keys = list(dict.fromkeys(key for keys in scan.every(list(local), "norms (keys)") for key in keys))
    roots = {}
    for key in keys:
        block = local.get(key, np.zeros(len(part.positions)))  # a part without the key: 0, as in one process
        roots[key] = np.sqrt(np.clip(scan.gather(block, part, f"norms ({key})"), 0, None))
    return roots if by_layer else roots.get("total", np.zeros(0))


def self_influence(
    store: StoreReader,
    capture_point: str | Sequence[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    **where: Any,
) -> np.ndarray:
    """TracIn self-influence ``sum_c lr_c ||g_i(w_c)||^2``, aligned with ``sample_ids`` of the first capture point.

    Several capture points (checkpoint passes) are summed per sample id (aligned with
    :func:`self_influence_ids`); ``lr`` is the one recorded with each batch (1 when none was).
    """
    scan = scan or scan_of(store)
    points = [capture_point] if capture_point is None or isinstance(capture_point, str) else list(capture_point)
    parts = []
    for point in points:
        selection = store.select(point, **where)
        part = scan.part(selection, f"self_influence of {point!r}")
        local = lr_sq_norms(part.selection, max_bytes, scan.device)  # (n,)
        parts.append((selection.sample_ids(), scan.gather(local, part, f"self_influence of {point!r}")))
    return summed_by_id(parts)


def lr_sq_norms(
    selection: Selection, max_bytes: int = DEFAULT_MAX_BYTES, device: torch.device | str | None = None
) -> np.ndarray:
    """``(N,)`` ``lr_b ||g_i||^2`` of a selection's samples (``lr_b`` of each sample's batch), in selection order;
    NaN for the samples of batches that hold no records (kept as metadata only by a capture policy)."""
    values = []
    for run, records in selection.merged(max_bytes // 2):
        sizes = [b.size for b in run]
        if not records:
            values.append(np.full(sum(sizes), np.nan))
            continue
        lr = np.repeat([b.ref.lr_weight for b in run], sizes)  # (n,)
        values.append(lr * ops.total_sq_norms(on_device(records, device)).double().cpu().numpy())
    return np.concatenate(values) if values else np.zeros(0)


def summed_by_id(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per-occurrence values of several capture points ``(ids_c, values_c)`` summed per sample id (first-seen order).

    One capture point is returned as it is (one value per occurrence, in selection order).
    """
    if len(parts) == 1:
        return parts[0][1]
    ids, positions = _union([ids for ids, _ in parts], "train")
    total = np.zeros(len(ids))
    for (_, part), pos in zip(parts, positions):
        np.add.at(total, pos, part)
    return total


def self_influence_ids(store: StoreReader, capture_points: Sequence[str], **where: Any) -> np.ndarray:
    """The sample ids :meth:`self_influence` of several capture points is aligned with."""
    return _union([store.sample_ids(cp, **where) for cp in capture_points], "train")[0]


def influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Scores:
    """TracIn scores ``sum_c lr_c <g_train_i(w_c), g_test_j(w_c)>`` over paired checkpoint passes.

    Args:
        train, test: capture points, paired in order (``["epoch-0/train", "epoch-1/train"]``
            with ``["epoch-0/val", "epoch-1/val"]``): train and test gradients of a pair
            were taken at the same weights. ``lr_c`` is the one recorded with the train pass.
        layers: restrict to these layers (all by default).
        train_ids, test_ids: restrict to these samples.
    """
    pairs = selected_pairs(store, train, test, layers=layers, train_ids=train_ids, test_ids=test_ids)
    return whole(scored_pairs(store, pairs, max_bytes=max_bytes))


#: ``(train capture point, test selection) -> column chunks``: what the train rows are scored against.
ColumnsOf = Callable[[str, Selection], Iterable[Sequence[ColumnBatch]]]
#: One paired pass: ``(train capture point, rows, test capture point, columns)``.
Pair = tuple[str, Selection, str, Selection]


def selected_pairs(
    store: StoreReader, train: str | Sequence[str], test: str | Sequence[str], **select: Any
) -> list[Pair]:
    """The paired passes (:func:`paired_points`) with their selections: ``select`` holds ``train_ids``, ``test_ids``
    (restrict each side to these samples) and ``store.select``'s filters of both (``layers=``)."""
    train_ids, test_ids = select.pop("train_ids", None), select.pop("test_ids", None)
    return [
        (a, store.select(a, sample_ids=train_ids, **select), b, store.select(b, sample_ids=test_ids, **select))
        for a, b in paired_points(train, test)
    ]


def pair_blocks(
    pairs: Sequence[Pair], columns: ColumnsOf | None, max_bytes: int, scan: Scan
) -> Iterator[tuple[Part, Selection, np.ndarray]]:
    """Per pair, this process's part of the rows, the columns, and its ``(n, M)`` block ``lr_b <g_i, g_j>``.

    The columns (``columns(train, cols)``, the test gradients by default) are read by one process
    and handed to all (:meth:`Scan.columns`).
    """
    read = columns or (lambda _, cols: chunked(cols, max_bytes))
    for train_cp, rows, test_cp, cols in pairs:
        part = scan.part(rows, f"influence of {train_cp!r}")
        chunks = scan.columns(partial(read, train_cp, cols), f"influence: test gradients of {test_cp!r}")
        yield part, cols, dot_blocks(part.selection, chunks, True, scan.device, max_bytes)  # (n, M)


def scored_pairs(
    store: StoreReader,
    pairs: Sequence[Pair],
    *,
    columns: ColumnsOf | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    dst: int | None = None,
) -> Scores | None:
    """``sum_c lr_c <g_i, g_j>`` over paired passes (:func:`pair_blocks`), summed per sample id.

    The score matrix is gathered on every process (``dst=None``) or on ``dst`` only: ``None`` elsewhere.
    """
    scan = scan or scan_of(store)
    row_parts, col_parts = [], []
    for (train_cp, rows, _, _), (part, cols, local) in zip(pairs, pair_blocks(pairs, columns, max_bytes, scan)):
        full = scan.gather_on(local, part, f"influence: scores of {train_cp!r}", dst)  # (N, M)
        if full is not None:
            row_parts.append((rows.sample_ids(), full))
            col_parts.append((cols.sample_ids(), full))
    return summed_scores(row_parts, col_parts) if row_parts else None


def whole(scores: Scores | None) -> Scores:
    """The scores of a query gathered on every process (never ``None``)."""
    if scores is None:
        raise StateError("a partitioned query gathered its scores on another rank; call it with dst=None")
    return scores


def nearest_occurrences(
    ids: np.ndarray, steps: np.ndarray, scores: np.ndarray, step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One entry per sample id of per-occurrence ``ids``, ``steps`` and ``scores`` (each ``(N,)``): the occurrence
    whose step is nearest ``step`` (the later on a tie). Returns ``(ids, scores, steps)``, ids ascending.

    For a query taken at ``step``, the gradients of the other samples taken at the nearest weights.
    """
    distance = np.abs(np.asarray(steps, dtype=np.int64) - step)  # (N,)
    order = np.lexsort((-np.asarray(steps), distance, ids))  # by id, then nearest, then later
    first = np.unique(np.asarray(ids)[order], return_index=True)[1]
    chosen = order[first]
    return np.asarray(ids)[chosen], np.asarray(scores)[chosen], np.asarray(steps)[chosen]


def similar(
    store: StoreReader,
    query: str,
    candidates: str,
    *,
    query_ids: Sequence[int] | None = None,
    cosine: bool = True,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    candidate_ids: Sequence[int] | None = None,
) -> Scores:
    """Cosine (or dot) similarity of gradients: rows are candidates (only ``candidate_ids``, when given),
    columns the query samples."""
    rows = store.select(candidates, sample_ids=candidate_ids, layers=layers)
    cols = store.select(query, sample_ids=query_ids, layers=layers)
    return whole(scored_similar(store, rows, cols, candidates, cosine=cosine, max_bytes=max_bytes))


def scored_similar(
    store: StoreReader,
    rows: Selection,
    cols: Selection,
    candidates: str,
    *,
    cosine: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    dst: int | None = None,
) -> Scores | None:
    """:func:`similar` of two selections (the candidates named ``candidates``), gathered as :func:`scored_pairs` does.

    Cosine divides by ``||g_i|| ||g_j||``: each process computes its rows' norms, one the columns'.
    """
    scan = scan or scan_of(store)
    part = scan.part(rows, f"similar in {candidates!r}")
    chunks = scan.columns(lambda: chunked(cols, max_bytes), "similar: query gradients")
    local = dot_blocks(part.selection, chunks, device=scan.device, max_bytes=max_bytes)  # (n, M)
    if cosine:
        row_sq = sq_norms(part.selection, device=scan.device).get("total", np.zeros(0))  # (n,)
        col_sq = scan.first(lambda: sq_norms(cols)["total"], "similar: query norms")  # (M,)
        local = ops.cosine(torch.from_numpy(local), torch.from_numpy(row_sq), torch.from_numpy(col_sq)).numpy()
    full = scan.gather_on(local, part, "similar: scores", dst)  # (N, M)
    return None if full is None else Scores(full, rows.sample_ids(), cols.sample_ids())
