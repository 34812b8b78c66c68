"""Selections of a store: which stored batches, samples and layers; loaded batch by batch.

A :class:`Selection` is cheap (it holds references into the manifests); tensors are read
from memory-mapped shards (``safetensors.safe_open``) only while iterating it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.progress import progress
from metastore_plugins.core.store import manifest as mf
from metastore_plugins.core.store.encoding import decode, is_scale_key
from metastore_plugins.core.store.manifest import StoreError
from metastore_plugins.core.store.record_check import check_record

#: Metadata columns every selection returns (missing values: -1 for ids/labels, NaN for floats).
BATCH_COLUMNS = ("step", "epoch", "micro_batch", "rank")


class ShardFiles:
    """Opens the shards of one store: checks a shard against its manifest entry (inside the
    run directory, size, sha256) the first time it is read, then remembers it is sound.

    Every error is a :class:`StoreError` naming the file; other shards stay readable.
    """

    def __init__(self, directory: Path, entries: dict[str, dict[str, Any]], checksums: bool = True) -> None:
        self.directory, self.entries, self.checksums = directory, entries, checksums
        self._sound: set[str] = set()
        self._lock = threading.Lock()
        #: (shard name, batch) -> checked per-sample metadata: small, and read by most queries
        self.meta: dict[tuple[str, int], dict[str, Tensor]] = {}
        self._open: dict[str, OpenShard] = {}

    def check(self, path: Path) -> None:
        name = path.name
        if name in self._sound:
            return
        with self._lock:
            entry = self.entries.get(name)
            if entry is None or path.parent != self.directory:
                raise StoreError(f"{path} is not a shard listed in the manifests of {self.directory}; not read")
            problem = mf.shard_problem(path, entry, self.checksums)
            if problem is not None:
                raise StoreError(f"{path}: {problem}; other shards stay readable, store.verify() lists all damage")
            self._sound.add(name)

    def open(self, path: Path) -> OpenShard:
        """The checked shard, opened once (``safe_open``) and kept while the store is in use.

        A file safetensors cannot parse raises :class:`StoreError`. Shards stay open while
        their files take at most :data:`MAX_OPEN_BYTES` together (the least recently used is
        closed first; the one just opened always stays): the pages of an open shard that were
        read stay mapped, and count as the process's memory.
        """
        self.check(path)
        with self._lock:
            shard = self._open.pop(path.name, None)
            if shard is None:
                shard = OpenShard(path)
            self._open[path.name] = shard  # most recently used last
            size = lambda name: int(self.entries[name]["bytes"])  # noqa: E731
            while len(self._open) > 1 and sum(size(name) for name in self._open) > MAX_OPEN_BYTES:
                self._open.pop(next(iter(self._open)))
        return shard


#: Bytes of shard files kept open per store: their parsed headers make repeated reads cheap.
MAX_OPEN_BYTES = 128 * 2**20


class OpenShard:
    """One ``safe_open`` handle and its tensor names grouped by stored batch (``"b3"`` -> keys).

    Parsing a shard's header is the costly part of opening it (a shard holds thousands of
    tensors), so it is done once; tensors read from it are independent copies.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # noqa: BLE001 - header too large, bad JSON header, bad offsets
            raise StoreError(f"{path}: not a readable safetensors file ({exc})") from exc
        self.keys: dict[str, list[str]] = {}
        for key in self.handle.keys():
            self.keys.setdefault(key.split("/", 1)[0], []).append(key)

    def read(self, batch: int, prefix: str) -> dict[str, Tensor]:
        """The tensors of stored batch ``batch`` whose names start with ``prefix``, without it."""
        return {
            key[len(prefix) :]: _get(self.handle, key, self.path)
            for key in self.keys.get(f"b{batch}", ())
            if key.startswith(prefix)
        }


def _get(handle: Any, key: str, path: Path) -> Tensor:
    try:
        return handle.get_tensor(key)
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"{path}: cannot read tensor {key!r} ({exc})") from exc


@dataclass(frozen=True)
class BatchRef:
    """Where one stored batch lives and what the manifest says about it."""

    file: Path
    batch: int  # index of the batch inside its shard
    info: dict[str, Any]  # capture point, step, epoch, micro-batch, rank, size, lr, records
    layers: dict[str, dict[str, Any]]  # the manifest's layer table (params, shapes, layout)
    files: ShardFiles | None = field(default=None, compare=False, repr=False)  # checks shards on first read

    def _shard(self) -> OpenShard:
        return self.files.open(self.file) if self.files is not None else OpenShard(self.file)

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

    @property
    def lr_weight(self) -> float:
        """The recorded learning rate, 1 where none was: the weight of this batch in TracIn sums."""
        lr = self.info.get("lr")
        return 1.0 if lr is None else float(lr)

    def order_key(self) -> tuple[int, int, int, str, int]:
        info = self.info
        return (info["step"], info["micro_batch"], info["rank"], self.file.name, self.batch)

    def may_hold(self, wanted: list[int]) -> bool:
        """Whether the shard's sample id range (manifest) meets ``wanted`` (sorted); True when unknown."""
        span = self.files.entries.get(self.file.name, {}).get("sample_ids") if self.files is not None else None
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) for v in span)):
            return True
        at = bisect.bisect_left(wanted, span[0])
        return at < len(wanted) and wanted[at] <= span[1]

    def read_meta(self) -> dict[str, Tensor]:
        """The batch's per-sample metadata columns (cached per store once checked)."""
        key = (self.file.name, self.batch)
        cached = self.files.meta.get(key) if self.files is not None else None
        if cached is None:
            cached = {
                column: value.clone() for column, value in self._read_meta().items()
            }  # not views of the mapped file
            if self.files is not None:
                self.files.meta[key] = cached
        return dict(cached)

    def _read_meta(self) -> dict[str, Tensor]:
        prefix = f"b{self.batch}/meta/"
        meta = self._shard().read(self.batch, prefix)
        ids = meta.get("sample_id")
        if (
            ids is None
            or ids.is_floating_point()
            or ids.dtype == torch.bool
            or ids.dim() != 1
            or ids.shape[0] != self.size
        ):
            got = "nothing" if ids is None else f"{ids.dtype} {tuple(ids.shape)}"
            raise StoreError(
                f"{self.file}: tensor {prefix}sample_id must be ({self.size},) integer sample ids; got {got}"
            )
        for column, value in meta.items():
            if value.dim() == 0 or value.shape[0] != self.size:
                raise StoreError(
                    f"{self.file}: tensor {prefix}{column} must have {self.size} rows; got {tuple(value.shape)}"
                )
        meta["sample_id"] = ids.long()
        return meta

    def read_records(self, layers: Sequence[str] | None = None) -> list[LayerRecord]:
        """Decode the batch's records (of ``layers`` only, when given)."""
        wanted = [(k, r) for k, r in enumerate(self.info["records"]) if layers is None or r["layer"] in layers]
        if not wanted:
            return []
        shard = self._shard()
        return [
            self._record(entry, shard.read(self.batch, f"b{self.batch}/r{k}/"), f"b{self.batch}/r{k}/")
            for k, entry in wanted
        ]

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
        refs = self.refs
        if self.sample_filter is not None:  # skip shards whose sample id range holds none of them
            wanted = sorted(self.sample_filter)
            refs = tuple(ref for ref in refs if ref.may_hold(wanted))
        for ref in progress(refs, len(refs), "reading store"):
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
