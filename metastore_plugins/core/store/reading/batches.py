"""Stored batches and the shard files that hold them: :class:`BatchRef` and :class:`ShardFiles`.

A shard is read whole into memory and checked (a regular file of the store, its size, checksum
and exact tensor keys) the first time this process needs it, then kept in the process's
:mod:`~metastore_plugins.core.store.reading.readcache` while the file's identity (device, inode, size,
mtime, ctime) stays the same: a shard replaced, truncated, rewritten or turned into a link
after an earlier read is read and checked again, never trusted from a cached check, and no
file is memory-mapped (a file truncated under a mapping kills the process). Each store also
holds the shards it is reading (:data:`MAX_OPEN_BYTES`) without looking at the file again,
so consecutive batches of one shard cost one lookup. Record tensors are views of the checked
bytes: read-only by contract (see :class:`~metastore_plugins.core.store.shards.shardread.ShardData`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import KIND_CODES, LayerRecord, meta_key, record_prefix
from metastore_plugins.core.store.reading.readcache import SHARDS
from metastore_plugins.core.store.reading.record_memo import RECORDS
from metastore_plugins.core.store.shards.encoding import decode, is_scale_key
from metastore_plugins.core.store.shards.index import StoreIndex
from metastore_plugins.core.store.shards.record_check import check_record
from metastore_plugins.core.store.shards.shardread import ShardData

#: Bytes of shards each store holds without looking at their files again (the least recently used is
#: dropped first; the one just read always stays). Beyond them, shards come from the process's cache.
MAX_OPEN_BYTES = 128 * 2**20


class ShardFiles:
    """Reads the shards of one store, each checked against its index entry when it is read."""

    def __init__(self, directory: Path, index: StoreIndex, checksums: bool = True) -> None:
        self.directory, self.index, self.checksums = directory, index, checksums
        self.by_name = {entry.file: s for s, entry in enumerate(index.shards)}
        self._lock = threading.Lock()
        self._open: OrderedDict[int, ShardData] = OrderedDict()
        self._refs: dict[int, BatchRef] = {}

    def open(self, shard: int) -> ShardData:
        """Shard ``shard``'s checked contents; :class:`StoreError` naming the file when it is damaged."""
        with self._lock:
            data = self._open.pop(shard, None)
            if data is None or not data.intact():
                path = self.directory / self.index.shards[shard].file
                try:
                    data = SHARDS.read(path, self.directory, self.index.expectation(shard, self.checksums, fast=True))
                except StoreError as exc:
                    raise StoreError(f"{exc}; other shards stay readable, store.verify() lists all damage") from exc
            self._open[shard] = data  # most recently used last
            while len(self._open) > 1 and sum(d.nbytes for d in self._open.values()) > MAX_OPEN_BYTES:
                self._open.popitem(last=False)
        return data

    def ref(self, row: int) -> BatchRef:
        """The :class:`BatchRef` of row ``row`` of the index's batch columns (made once)."""
        ref = self._refs.get(row)
        if ref is None:
            ref = self._refs[row] = BatchRef.of(self, row)
        return ref


@dataclass(frozen=True)
class BatchRef:
    """Where one stored batch lives and what the index says about it."""

    file: Path
    batch: int  # index of the batch inside its shard
    info: dict[str, Any]  # capture point, step, epoch, micro-batch, rank, size, lr, records
    layers: dict[str, dict[str, Any]]  # the layer table (params, shapes, layout)
    files: ShardFiles = field(compare=False, repr=False)
    row: int = 0  # the batch's row in the index

    @classmethod
    def of(cls, files: ShardFiles, row: int) -> BatchRef:
        index = files.index
        b, r = index.batch, index.record
        rec0, nrec = int(b["rec0"][row]), int(b["nrec"][row])
        records = [
            {
                "layer": index.layer_names[int(r["layer"][k])],
                "kind": KIND_CODES[int(r["kind"][k])],
                **{key: int(r[key][k]) for key in ("rows", "bytes", "dense_bytes")},
            }
            for k in range(rec0, rec0 + nrec)
        ]
        lr = float(b["lr"][row])
        info = {
            "capture_point": index.capture_point_names[int(b["capture_point"][row])],
            **{key: int(b[key][row]) for key in ("step", "epoch", "micro_batch", "rank", "size")},
            "lr": None if np.isnan(lr) else lr,
            "records": records,
        }
        file = files.directory / index.shards[int(b["shard"][row])].file
        return cls(file, int(b["j"][row]), info, index.layers, files, row)

    @property
    def capture_point(self) -> str:
        return self.info["capture_point"]

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def size(self) -> int:
        return int(self.info["size"])

    @property
    def lr(self) -> float | None:
        return self.info["lr"]

    @property
    def lr_weight(self) -> float:
        """The recorded learning rate, 1 where none was: the weight of this batch in TracIn sums."""
        lr = self.info["lr"]
        return 1.0 if lr is None else float(lr)

    def _shard(self) -> ShardData:
        return self.files.open(int(self.files.index.batch["shard"][self.row]))

    def read_records(self, layers: Sequence[str] | None = None) -> list[LayerRecord]:
        """Decode the batch's records (of ``layers`` only, when given).

        The shard's own sample ids of the batch must be the ones the index lists.
        """
        wanted = [(k, r) for k, r in enumerate(self.info["records"]) if layers is None or r["layer"] in layers]
        if not wanted:
            return []
        shard = self._shard()
        self._check_sample_ids(shard)
        return self.records_in(shard, layers)

    def records_in(self, shard: ShardData, layers: Sequence[str] | None = None) -> list[LayerRecord]:
        """The batch's records decoded from ``shard`` (its checked contents), each checked against the manifest's
        layer (:func:`~metastore_plugins.core.store.shards.record_check.check_record`): what queries and ``verify``
        read."""
        wanted = [k for k, r in enumerate(self.info["records"]) if layers is None or r["layer"] in layers]
        return RECORDS.records(shard, (self.batch, tuple(wanted)), lambda: [self.record_at(shard, k) for k in wanted])

    def record_at(self, shard: ShardData, k: int) -> LayerRecord:
        """Record ``k`` of the batch decoded from ``shard`` and checked; :class:`StoreError` naming the shard."""
        prefix = record_prefix(self.batch, k)
        return self._record(self.info["records"][k], shard.read(self.batch, prefix), prefix)

    def _check_sample_ids(self, shard: ShardData) -> None:
        key = meta_key(self.batch, "sample_id")
        stored = shard.get(key)
        index = self.files.index
        row0 = int(index.batch["row0"][self.row])
        listed = index.sample["sample_id"][row0 : row0 + self.size]
        if stored.dim() != 1 or stored.is_floating_point() or not np.array_equal(stored.long().numpy(), listed):
            raise StoreError(f"{self.file}: tensor {key} does not hold the {self.size} sample ids the index lists")

    def _record(self, entry: dict[str, Any], stored: dict[str, Tensor], prefix: str = "") -> LayerRecord:
        layer = self.layers[entry["layer"]]
        try:
            tensors = {key: decode(stored, key) for key in stored if not is_scale_key(key, stored)}
        except RuntimeError as exc:  # a row scale that does not fit its tensor
            raise StoreError(f"{self.file}: cannot decode record {prefix} ({exc})") from exc
        check_record(self.file, prefix, entry, layer, self.size, stored, tensors)
        return LayerRecord(
            layer=entry["layer"],
            kind=entry["kind"],
            batch_size=self.size,
            params=dict(layer["params"]),
            param_shapes={role: tuple(shape) for role, shape in layer["param_shapes"].items()},
            tensors=tensors,
            layout=layer["layout"],
        )


def tensor_column(values: np.ndarray) -> Tensor:
    """A metadata column as a tensor (a copy: callers may modify it)."""
    return torch.from_numpy(np.array(values))
