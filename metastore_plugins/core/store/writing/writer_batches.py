"""What a :class:`~metastore_plugins.core.store.writing.writer.StoreWriter` queues and counts: a batch, its
statistics, and what a shard's description lists of the batches it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from metastore_plugins.core.records import LayerRecord, meta_key, record_key


@dataclass
class Batch:
    """One queued batch: its records, per-sample columns, batch fields and size in bytes."""

    records: list[LayerRecord]
    meta: dict[str, Tensor]  # column -> (B, ...)
    info: dict[str, Any]  # capture point, step, epoch, micro-batch, rank, size, lr
    nbytes: int


@dataclass
class WriterStats:
    """What the writer did: bytes, shards, and how long training waited on it."""

    shards: int = 0
    bytes_written: int = 0
    peak_queued_bytes: int = 0
    peak_pending_bytes: int = 0  # encoded bytes of the shard being built
    wait_seconds: float = 0.0
    batches: int = 0
    dense_bytes: int = 0  # what the same samples' dense fp32 per-sample gradients would take
    files: list[str] = field(default_factory=list)
    timer_shards: int = 0  # shards written because the oldest unwritten batch waited flush_seconds / 2


def record_info(record: LayerRecord) -> dict[str, Any]:
    """What a journal line lists of a record: layer, kind, rows and bytes."""
    rows = int(record.tensors["sample"].shape[0]) if "sample" in record.tensors else record.batch_size
    return {
        "layer": record.layer,
        "kind": record.kind,
        "rows": rows,
        "bytes": record.nbytes,
        "dense_bytes": record.dense_nbytes,
    }


def shard_keys(pending: list[Batch]) -> list[tuple[str, int]]:
    """``(key, ndim)`` of the record and metadata tensors a shard of ``pending`` holds (``.scale`` keys left out)."""
    keys = [(meta_key(j, column), t.dim()) for j, b in enumerate(pending) for column, t in b.meta.items()]
    return keys + [
        (record_key(j, k, name), t.dim())
        for j, b in enumerate(pending)
        for k, r in enumerate(b.records)
        for name, t in r.tensors.items()
    ]
