"""Selections of a store: which stored batches, samples and layers; loaded batch by batch.

A :class:`Selection` is cheap: rows of the index's columns. Sample ids and metadata are read
from the index as whole numpy columns; tensors are read from shards only while iterating
:meth:`Selection.batches`.

While the caller works on the batches of one shard, the next shards (:data:`READ_AHEAD`) are read
and checked on one background thread (:class:`ReadAhead`), into the process's read cache
(:mod:`~metastore_plugins.core.store.reading.readcache`), so reading hides behind the arithmetic. The
batches are still decoded from what :meth:`~metastore_plugins.core.store.reading.batches.ShardFiles.open`
returns: the cache's checked bytes of a file whose identity is unchanged since it was read, else
a fresh read and check in the caller, so the guarantees of the safe read path are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from types import TracebackType

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.progress import progress
from metastore_plugins.core.records import EIGENBASIS_TENSORS, FLOAT_SAMPLE_COLUMNS, SAMPLE_COLUMNS, LayerRecord
from metastore_plugins.core.store.reading.batches import BatchRef, ShardFiles, tensor_column
from metastore_plugins.core.store.reading.readcache import SHARDS

#: Batch columns every selection returns beside the per-sample ones (SAMPLE_COLUMNS: -1 or NaN where missing).
BATCH_COLUMNS = ("step", "epoch", "micro_batch", "rank")


def subset_record(record: LayerRecord, keep: Tensor) -> LayerRecord:
    """The record restricted to the samples ``keep`` (``(n,)`` batch-local indices, ascending)."""
    if keep.numel() == record.batch_size:
        return record
    if "sample" not in record.tensors:  # one row per sample: dense, projected, norms (a basis's tensors are not)
        tensors = {key: value if key in EIGENBASIS_TENSORS else value[keep] for key, value in record.tensors.items()}
    else:
        new_index = torch.full((record.batch_size,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(keep.numel())
        sample = record.tensors["sample"].long()  # (R,)
        rows = (new_index[sample] >= 0).nonzero().squeeze(1)  # (R_kept,)
        tensors = {key: value[rows] for key, value in record.tensors.items()}
        tensors["sample"] = new_index[sample[rows]]
    return replace(record, batch_size=int(keep.numel()), tensors=tensors)


def _signature(batch: StoredBatch) -> list[tuple[str, str, tuple[tuple[str, tuple[int, ...]], ...], int | None]]:
    """What batches must share to be joined: layers, kinds, each tensor's shape past its rows (a run whose
    plan lowered its projection mid-way holds 16x16 and 8x8 records of one layer, which cannot be stacked) and the
    curvature eigenbasis (training steps go on each checkpoint's in turn)."""
    return [
        (r.layer, r.kind, tuple((k, tuple(t.shape[1:])) for k, t in r.tensors.items()), r.basis) for r in batch.records
    ]


def join_records(batches: list[list[LayerRecord]]) -> list[LayerRecord]:
    """Records of batches with the same layers and kinds in the same order, as one batch's records.

    Samples follow batch order: ``sample`` indices of later batches are offset by the sizes before.
    """
    if len(batches) == 1:
        return batches[0]
    joined = []
    for records in zip(*batches):
        first, offset, parts = records[0], 0, []
        for record in records:
            tensors = dict(record.tensors)
            if "sample" in tensors:
                tensors["sample"] = tensors["sample"].long() + offset  # (R,)
            parts.append(tensors)
            offset += record.batch_size
        if len({record.basis for record in records}) > 1:
            raise RepresentationError(
                f"layer '{first.layer}' is kept on two curvature eigenbases in one selection; select one checkpoint's"
                " passes"
            )
        tensors = {
            key: first.tensors[key] if key in EIGENBASIS_TENSORS else torch.cat([part[key] for part in parts])
            for key in first.tensors
        }  # one basis: its tensors once
        joined.append(replace(first, batch_size=offset, tensors=tensors))
    return joined


#: Shards read ahead of the one in use (0: none), while they fit in the read cache's allowance with it.
#: Off: where torch's threads take every core it does not shorten a first query, it moves the reading's CPU time
#: into the products (docs/store.md). On, 4: a run of joined batches (influence's rows) spans 2-3 shards, and 4
#: read the next run's meanwhile (docs/benchmarks.md, issue 35).
READ_AHEAD = 0


class ReadAhead:
    """Reads the shards a scan needs next on one background thread, into the process's read cache.

    ``shards``: the shard of each batch the scan reads, in order. :meth:`using` is called before the
    batches of a shard are read: it waits for that shard's read ahead (if one was started) and starts
    those of the next :data:`READ_AHEAD` shards, as long as the shard in use and those ahead fit in
    :meth:`~metastore_plugins.core.store.reading.readcache.ShardCache.limit` (a read ahead the cache would not
    keep would be read twice). A read ahead that failed is not reported here: the caller's own read of
    that shard (``ShardFiles.open``) reads and checks it again and raises what it finds, with its
    usual message. :meth:`close` (or leaving the ``with`` block) cancels what has not started and
    waits for the thread to end.
    """

    def __init__(self, files: ShardFiles, shards: Sequence[int], ahead: int | None = None) -> None:
        self.files = files
        self.order = list(dict.fromkeys(int(s) for s in shards))  # (n_s,) shards in order of first use
        self.ahead = READ_AHEAD if ahead is None else ahead
        self._first = {shard: i for i, shard in enumerate(self.order)}
        self._next = 0  # position in order of the first shard not yet read ahead or used
        self._pending: dict[int, Future[None]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _bytes(self, shard: int) -> int:
        return int(self.files.index.shards[shard].bytes)

    def _read(self, shard: int) -> None:
        files = self.files  # into the cache only: a pending read holds no bytes of its own
        path = files.directory / files.index.shards[shard].file
        SHARDS.read(path, files.directory, files.index.expectation(shard, files.checksums, fast=True))

    def using(self, shard: int) -> None:
        """Shard ``shard`` is about to be read: wait for its read ahead, start the next ones."""
        shard = int(shard)
        future = self._pending.pop(shard, None)
        if future is not None:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the caller's own read raises it (see the class)
                pass
        self._next = max(self._next, self._first[shard] + 1) if shard in self._first else self._next
        self._start(self._bytes(shard))

    def start(self) -> ReadAhead:
        """Start reading the first shards before any is used (a scan that reads something else first)."""
        self._start(0)
        return self

    def _start(self, used: int) -> None:
        """Start the next reads while fewer than ``ahead`` are pending and they fit beside ``used`` bytes."""
        if self.ahead <= 0:
            return
        used += sum(self._bytes(s) for s in self._pending)
        limit = SHARDS.limit()
        while self._next < len(self.order) and len(self._pending) < self.ahead:
            nxt = self.order[self._next]
            if used + self._bytes(nxt) > limit:
                break  # kept until used only within the allowance
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="metastore-read-ahead")
            self._pending[nxt] = self._pool.submit(self._read, nxt)
            used += self._bytes(nxt)
            self._next += 1

    def close(self) -> None:
        """Cancel the reads not started and wait for the thread to end (no thread is left running)."""
        pool, self._pool = self._pool, None
        self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class StoredBatch:
    """One stored batch, restricted to a selection: its metadata columns and records."""

    ref: BatchRef
    meta: dict[str, Tensor]  # column -> (n, ...)
    records: list[LayerRecord]

    @property
    def size(self) -> int:
        return int(self.meta["sample_id"].shape[0])


@dataclass(frozen=True)
class Selection:
    """Stored batches in selection order (rows of the index), optionally restricted to some samples and layers."""

    files: ShardFiles
    batch_rows: np.ndarray  # (n_b,) rows of the index's batch columns
    sample_filter: np.ndarray | None = None  # sorted sample ids to keep
    layers: tuple[str, ...] | None = None

    @property
    def refs(self) -> tuple[BatchRef, ...]:
        return tuple(self.files.ref(int(row)) for row in self.batch_rows)

    @cached_property
    def _rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(sample rows, position in batch_rows of each row's batch)`` of the selected samples."""
        rows, at = self.files.index.rows(self.batch_rows)
        if self.sample_filter is not None:
            keep = np.isin(self.files.index.sample["sample_id"][rows], self.sample_filter)
            rows, at = rows[keep], at[keep]
        return rows, at

    def batches(self, with_records: bool = True) -> Iterator[StoredBatch]:
        """Load the selected batches one at a time (batches left with no sample are skipped)."""
        index = self.files.index
        rows, at = self._rows
        positions, starts, counts = np.unique(at, return_index=True, return_counts=True)
        shards = self._shards(positions)
        with ReadAhead(self.files, shards.tolist() if with_records else []) as ahead:
            steps = zip(positions, starts, counts, shards.tolist())
            for position, start, count, shard in progress(steps, len(positions), "reading store"):
                ref = self.files.ref(int(self.batch_rows[position]))
                kept = rows[start : start + count]  # (n,) sample rows
                meta = {key: tensor_column(index.sample[key][kept]) for key in index.sample}
                records = []
                if with_records:
                    ahead.using(shard)  # this shard's read ahead done, the next ones started
                    keep = torch.from_numpy(kept - int(index.batch["row0"][ref.row]))  # (n,) batch-local
                    records = [subset_record(r, keep) for r in ref.read_records(self.layers)]
                yield StoredBatch(ref, meta, records)

    def _shards(self, positions: np.ndarray | None = None) -> np.ndarray:
        """``(n,)`` the shard of each batch read (at ``positions`` of ``batch_rows``; by default those with a
        selected sample), in order."""
        if positions is None:
            positions = np.unique(self._rows[1])
        return self.files.index.batch["shard"][self.batch_rows[positions]] if len(positions) else np.zeros(0, np.int64)

    def read_ahead(self) -> ReadAhead:
        """The :class:`ReadAhead` of this selection's shards, its first ones started: a ``with`` block around
        other reading (a product's columns) reads them meanwhile, and :meth:`batches` then finds them read."""
        return ReadAhead(self.files, self._shards().tolist()).start()

    def chunks(self, max_bytes: int) -> Iterator[list[StoredBatch]]:
        """Groups of consecutive batches whose records take at most ``max_bytes`` (at least one batch)."""
        group: list[StoredBatch] = []
        used = 0
        for batch in self.batches():
            size = sum(r.nbytes for r in batch.records)
            if group and used + size > max_bytes:
                yield group
                group, used = [], 0
            group.append(batch)
            used += size
        if group:
            yield group

    def merged(self, max_bytes: int) -> Iterator[tuple[list[StoredBatch], list[LayerRecord]]]:
        """Runs of consecutive batches (at most ``max_bytes`` of records) with the same records (layer, kind and
        shapes past the rows, in order: :func:`_signature`), and their records joined as if they were one batch:
        one op call per run instead of one per batch (a step of a small model holds a few samples)."""
        for chunk in self.chunks(max_bytes):
            run: list[StoredBatch] = []
            for batch in chunk:
                if run and _signature(run[0]) != _signature(batch):
                    yield run, join_records([b.records for b in run])
                    run = []
                run.append(batch)
            if run:
                yield run, join_records([b.records for b in run])

    def metadata(self) -> dict[str, np.ndarray]:
        """Per-sample columns, one row per selected sample occurrence, in selection order.

        sample_id, label, loss, prediction, margin (-1 or NaN where not stored), step, epoch,
        micro_batch, rank, lr (NaN where none was given), capture_point.
        """
        index = self.files.index
        rows, at = self._rows
        batch = self.batch_rows[at]  # (N,) index row of each sample's batch
        columns: dict[str, np.ndarray] = {}
        for key in SAMPLE_COLUMNS:
            if key in index.sample:
                columns[key] = index.sample[key][rows]
            else:
                columns[key] = (
                    np.full(len(rows), np.nan, np.float32) if key in FLOAT_SAMPLE_COLUMNS else np.full(len(rows), -1)
                )
        for key in BATCH_COLUMNS:
            columns[key] = index.batch[key][batch]
        columns["lr"] = index.batch["lr"][batch]
        names = np.array(index.capture_point_names, dtype=object)
        columns["capture_point"] = names[index.batch["capture_point"][batch]] if len(names) else np.zeros(0, object)
        return columns

    def sample_ids(self) -> np.ndarray:
        """``(N,)`` int64 dataset indices of the selected sample occurrences, in selection order."""
        return self.files.index.sample["sample_id"][self._rows[0]]

    def __len__(self) -> int:
        return len(self._rows[0])
