"""Records decoded and checked once while the reports (or the default answer) are built, not once per query.

The reports ask several questions of the same records: the default answer reads the training steps to fit
each step window's curvature and again to score them, self-influence and the norms heatmap read them again
for their squared norms. Each read of a record decodes its tensors and checks them against the manifest
(:meth:`~.batches.BatchRef.records_in`), about 80 us a record: on the MiniLM example's store (2,592 step
records), five reads were 1.2 s of its 3.8 s of reports. Inside :meth:`RecordMemo.active` the records of a
batch are decoded once and handed out again while the shard they came from is the same file, unchanged
(the very bytes :mod:`.readcache` keeps for it: a file changed on disk, or whose bytes a caller changed in place,
is read again, and its records decoded again), within a byte allowance (least recently used dropped first).

Each caller gets its own :class:`~metastore_plugins.core.records.LayerRecord` objects and dicts; the tensors
are shared, read-only by the same contract as a shard's bytes (:class:`~.shardread.ShardData`). Outside the
block nothing is kept: a query streams its records within its memory budget.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store.shards.shardread import ShardData


class RecordMemo:
    """Decoded records by key, kept only inside :meth:`active` (``max_bytes`` of their tensors)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[Hashable, tuple[list[LayerRecord], weakref.ref[ShardData], int]] = OrderedDict()
        self._blocks: list[int] = []  # the allowances of the blocks open now (several threads may each be in one)

    @property
    def max_bytes(self) -> int:
        """The largest allowance of the blocks open; 0 (nothing kept) outside every block."""
        return max(self._blocks, default=0)

    @contextmanager
    def active(self, max_bytes: int) -> Iterator[None]:
        """Keep decoded records inside the block, at most ``max_bytes`` of them (the largest allowance of the
        blocks open); all dropped when the last block closes."""
        with self._lock:
            self._blocks.append(max_bytes)
        try:
            yield
        finally:
            with self._lock:
                self._blocks.remove(max_bytes)
                if not self._blocks:
                    self._kept.clear()

    def records(self, shard: ShardData, key: Hashable, read: Callable[[], list[LayerRecord]]) -> list[LayerRecord]:
        """The records ``key`` of ``shard``: those kept from these bytes (as new objects), else ``read()``, kept
        when the block is active."""
        if self.max_bytes <= 0:
            return read()
        key = (str(shard.path), key)
        with self._lock:
            found = self._kept.get(key)
            if found is not None and found[1]() is not shard:  # not the bytes read now (a file changed, re-read)
                del self._kept[key]
                found = None
            if found is not None:
                self._kept.move_to_end(key)
        if found is not None:
            return [_copy(record) for record in found[0]]
        records = read()
        size = sum(record.nbytes for record in records)
        if size <= self.max_bytes:
            with self._lock:
                self._kept[key] = (records, weakref.ref(shard), size)
                total = sum(kept[2] for kept in self._kept.values())
                while total > self.max_bytes:
                    total -= self._kept.popitem(last=False)[1][2]
        return [_copy(record) for record in records]


def _copy(record: LayerRecord) -> LayerRecord:
    """A record of its own dicts (the tensors shared)."""
    return dataclasses.replace(
        record,
        params=dict(record.params),
        param_shapes=dict(record.param_shapes),
        tensors=dict(record.tensors),
        meta=dict(record.meta),
    )


#: The most bytes of decoded records kept while one answer asks its several questions (the reports, the default
#: answer; the MiniLM example's store decodes to 35 MB).
MEMO_BYTES = 256 * 2**20

#: The process's memo, used by every store's reads (:meth:`~.batches.BatchRef.records_in`); active while the
#: reports are built (:func:`~metastore_plugins.core.training.report_pass.report_run`) and while the default answer
#: is computed (:func:`~metastore_plugins.core.analysis.default_answer.default_influence`).
RECORDS = RecordMemo()
