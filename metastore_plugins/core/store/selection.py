"""Selections of a store: which stored batches, samples and layers; loaded batch by batch.

A :class:`Selection` is cheap (it holds references into the manifests); tensors are read
from memory-mapped shards (``safetensors.safe_open``) only while iterating it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.store.progress import progress
from metastore_plugins.core.store.encoding import decode, is_scale_key

#: Metadata columns every selection returns (missing values: -1 for ids/labels, NaN for floats).
BATCH_COLUMNS = ("step", "epoch", "micro_batch", "rank")


@dataclass(frozen=True)
class BatchRef:
    """Where one stored batch lives and what the manifest says about it."""

    file: Path
    batch: int  # index of the batch inside its shard
    info: dict[str, Any]  # capture point, step, epoch, micro-batch, rank, size, lr, records
    layers: dict[str, dict[str, Any]]  # the manifest's layer table (params, shapes, layout)

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
        return self.info.get("lr")

    def order_key(self) -> tuple[int, int, int, str, int]:
        info = self.info
        return (info["step"], info["micro_batch"], info["rank"], self.file.name, self.batch)

    def read_meta(self) -> dict[str, Tensor]:
        prefix = f"b{self.batch}/meta/"
        with safe_open(str(self.file), framework="pt") as handle:
            return {key[len(prefix) :]: handle.get_tensor(key) for key in handle.keys() if key.startswith(prefix)}

    def read_records(self, layers: Sequence[str] | None = None) -> list[LayerRecord]:
        """Decode the batch's records (of ``layers`` only, when given)."""
        wanted = [(k, r) for k, r in enumerate(self.info["records"]) if layers is None or r["layer"] in layers]
        if not wanted:
            return []
        records = []
        with safe_open(str(self.file), framework="pt") as handle:
            keys = list(handle.keys())
            for k, entry in wanted:
                prefix = f"b{self.batch}/r{k}/"
                stored = {key[len(prefix) :]: handle.get_tensor(key) for key in keys if key.startswith(prefix)}
                records.append(self._record(entry, stored))
        return records

    def _record(self, entry: dict[str, Any], stored: dict[str, Tensor]) -> LayerRecord:
        layer = self.layers[entry["layer"]]
        tensors = {key: decode(stored, key) for key in stored if not is_scale_key(key, stored)}
        return LayerRecord(
            layer=entry["layer"],
            kind=entry["kind"],
            batch_size=self.size,
            params=dict(layer["params"]),
            param_shapes={role: tuple(shape) for role, shape in layer["param_shapes"].items()},
            tensors=tensors,
            layout=layer["layout"],
        )


def subset_record(record: LayerRecord, keep: Tensor) -> LayerRecord:
    """The record restricted to the samples ``keep`` (``(n,)`` batch-local indices, ascending)."""
    if keep.numel() == record.batch_size:
        return record
    if record.kind == "dense":
        tensors = {key: value[keep] for key, value in record.tensors.items()}
    else:
        new_index = torch.full((record.batch_size,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(keep.numel())
        sample = record.tensors["sample"].long()  # (R,)
        rows = (new_index[sample] >= 0).nonzero().squeeze(1)  # (R_kept,)
        tensors = {key: value[rows] for key, value in record.tensors.items()}
        tensors["sample"] = new_index[sample[rows]]
    return replace(record, batch_size=int(keep.numel()), tensors=tensors)


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
    """Stored batches (in step order), optionally restricted to some samples and layers."""

    refs: tuple[BatchRef, ...]
    sample_filter: frozenset[int] | None = None
    layers: tuple[str, ...] | None = None

    def _keep(self, ids: Tensor) -> Tensor:
        if self.sample_filter is None:
            return torch.arange(ids.shape[0])
        wanted = torch.tensor(sorted(self.sample_filter), dtype=torch.long)
        return torch.isin(ids, wanted).nonzero().squeeze(1)

    def batches(self, with_records: bool = True) -> Iterator[StoredBatch]:
        """Load the selected batches one at a time (batches left with no sample are skipped)."""
        for ref in progress(self.refs, len(self.refs), "reading store"):
            meta = ref.read_meta()
            keep = self._keep(meta["sample_id"])  # (n,)
            if keep.numel() == 0:
                continue
            meta = {key: value[keep] for key, value in meta.items()}
            records = [subset_record(r, keep) for r in ref.read_records(self.layers)] if with_records else []
            yield StoredBatch(ref, meta, records)

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

    def metadata(self) -> dict[str, np.ndarray]:
        """Per-sample columns, one row per selected sample occurrence, in selection order."""
        columns: dict[str, list[np.ndarray]] = {}
        parts = list(self.batches(with_records=False))
        names = {"sample_id", "label", "loss", "prediction"}.union(*(b.meta for b in parts))
        for batch in parts:
            n = batch.size
            for name in sorted(names):
                value = batch.meta.get(name)
                if value is None:
                    array = np.full(n, np.nan if name == "loss" else -1)
                else:
                    array = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
                columns.setdefault(name, []).append(array)
            info = batch.ref.info
            for name in BATCH_COLUMNS:
                columns.setdefault(name, []).append(np.full(n, info[name], dtype=np.int64))
            columns.setdefault("lr", []).append(np.full(n, np.nan if info["lr"] is None else info["lr"]))
            columns.setdefault("capture_point", []).append(np.full(n, info["capture_point"], dtype=object))
        return {name: np.concatenate(parts_) if parts_ else np.zeros(0) for name, parts_ in columns.items()}

    def sample_ids(self) -> np.ndarray:
        """``(N,)`` int64 dataset indices of the selected sample occurrences, in selection order."""
        ids = [b.meta["sample_id"].numpy() for b in self.batches(with_records=False)]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        if self.sample_filter is None:
            return sum(ref.size for ref in self.refs)
        return len(self.sample_ids())
