"""Which batches of a shard no journal line lists are held, byte for byte, by listed shards (:class:`ShardCopies`):
repair removes such a shard (a compaction's leftover) only where every batch of it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import ShardEntry
from metastore_plugins.core.store.shards.index import expectation
from metastore_plugins.core.store.shards.shardinfo import batch_prints
from metastore_plugins.core.store.shards.shardread import read_shard


class ShardCopies:
    """Which batches of unlisted shards listed shards hold byte for byte: the same tensors (sample ids included)
    under the same description (capture point, step, epoch, micro-batch, learning rate); listed shards are read
    only when their sample ids match."""

    def __init__(self, directory: Path, layers: dict[str, Any], entries: list[ShardEntry]) -> None:
        self.directory, self.layers, self.entries = directory, layers, list(entries)
        self._prints: dict[int, set[bytes]] = {}  # entry position -> its batches' labelled digests (read once)
        self._by_ids: dict[tuple[int, bytes], list[int]] | None = None

    def add(self, entry: ShardEntry, prints: list[bytes] | None) -> None:
        self.entries.append(entry)
        self._prints[len(self.entries) - 1] = _labelled(entry, prints)
        self._by_ids = None

    def held(self, data: Any, prints: list[bytes] | None, entry: ShardEntry) -> list[bool] | None:
        """Per batch of ``data`` (described by ``entry``), whether a listed shard holds it; None when its batches
        cannot be told apart."""
        if prints is None or len(prints) != len(entry.batches["size"]):
            return None
        out, keys = [], set(data.keys())
        for j, (digest, label) in enumerate(zip(prints, entry.batch_labels())):
            key = mf.meta_key(j, "sample_id")
            ids = data.get(key).numpy() if key in keys else None
            candidates = self._candidates(ids)
            out.append(any(label.encode() + digest in self._prints_of(i) for i in candidates))
        return out

    def _candidates(self, ids: np.ndarray | None) -> list[int]:
        if ids is None or any(e.samples is None for e in self.entries):  # version 1: no sample columns yet
            return list(range(len(self.entries)))
        if self._by_ids is None:
            self._by_ids = {}
            for i, entry in enumerate(self.entries):
                assert entry.samples is not None
                sizes = entry.batches["size"]
                for part in np.split(entry.samples["sample_id"], np.cumsum(sizes)[:-1]):
                    self._by_ids.setdefault((len(part), part.astype("<i8").tobytes()), []).append(i)
        return self._by_ids.get((len(ids), ids.astype("<i8").tobytes()), [])

    def _prints_of(self, i: int) -> set[bytes]:
        if i not in self._prints:
            entry = self.entries[i]
            try:
                data = read_shard(self.directory / entry.file, self.directory, expectation(entry, self.layers, True))
                self._prints[i] = _labelled(entry, batch_prints(data))
            except StoreError:
                self._prints[i] = set()  # a damaged listed shard holds no sound copy
        return self._prints[i]


def _labelled(entry: ShardEntry, prints: list[bytes] | None) -> set[bytes]:
    """Each batch's digest behind its description (:meth:`ShardEntry.batch_labels`); empty when they do not pair."""
    labels = entry.batch_labels()
    return set() if prints is None or len(prints) != len(labels) else {a.encode() + b for a, b in zip(labels, prints)}
