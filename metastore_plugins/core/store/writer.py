"""``StoreWriter``: queues records to a background thread that writes whole safetensors shards.

Example::

    with StoreWriter("runs/demo/store", rank=0) as writer:
        with CaptureSession(model) as session:
            loss_fn(model(x), y).backward()
        writer.write(session.factors(), sample_ids=ids, step=0, labels=y, losses=per_sample_loss)

Training waits only when the queue holds ``queue_bytes`` already (backpressure); the
writer's memory stays within ``queue_bytes`` plus one shard's records (``shard_bytes``
encoded, plus the batch that crossed it). See ``docs/store.md``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.store import manifest as mf
from metastore_plugins.core.store.encoding import DEFAULT_ENCODING, Encoding, check_encoding, encoded_nbytes
from metastore_plugins.core.store.shardfile import ShardBuffer, write_shard

ArrayLike = Tensor | Sequence[float] | Sequence[int]


@dataclass
class _Batch:
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


def _column(name: str, values: ArrayLike | None, size: int, dtype: torch.dtype | None) -> Tensor | None:
    if values is None:
        return None
    column = torch.as_tensor(values).detach().cpu()
    if dtype is not None:
        column = column.to(dtype)
    if column.dim() == 0 or column.shape[0] != size:
        raise ValueError(f"{name} must have one entry per sample ({size}); got shape {tuple(column.shape)}")
    return column.contiguous().clone()  # the caller may reuse its buffer before the shard is written


class StoreWriter:
    """Writes records and per-sample metadata of one process rank to a run directory.

    Args:
        path: the run directory (created). An existing store of the same rank is continued.
        rank: the process rank; each rank writes its own shards and manifest.
        encoding: ``"fp32"``, ``"fp16"`` (default), ``"bf16"`` or ``"int8"``, see
            :mod:`~metastore_plugins.core.store.encoding`.
        queue_bytes: the most record bytes waiting for the writer thread.
        shard_bytes: a shard is written once its encoded tensors reach this size.
        config: the run's configuration, kept in the manifest.
        on_error: what an ``OSError`` while writing a shard or the manifest (a full disk)
            does. ``"warn"`` (default): capture stops, later ``write()`` calls drop their
            data, and the next ``write``/``flush``/``close`` warns once, naming the directory
            and what the store kept; training goes on. ``"raise"``: the next
            ``write``/``flush``/``close`` raises ``RuntimeError``. Either way the shards already
            listed and the last manifest stay valid, and the partial file is removed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int = 0,
        encoding: Encoding = DEFAULT_ENCODING,
        queue_bytes: int = 256 * 2**20,
        shard_bytes: int = 64 * 2**20,
        config: dict[str, Any] | None = None,
        on_error: Literal["warn", "raise"] = "warn",
    ) -> None:
        if queue_bytes <= 0 or shard_bytes <= 0:
            raise ValueError("queue_bytes and shard_bytes must be positive byte counts")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise'; got {on_error!r}")
        self.on_error = on_error
        self.stopped: OSError | None = None  # the disk error that stopped capture (on_error="warn")
        self._warned = False
        self.dropped_samples = 0
        self.path = Path(path)
        self.rank = int(rank)
        self.encoding = check_encoding(encoding)
        self.queue_bytes, self.shard_bytes = int(queue_bytes), int(shard_bytes)
        self.stats = WriterStats()
        self.path.mkdir(parents=True, exist_ok=True)
        self._manifest = self._open_manifest(config or {})
        self._next_shard = self._first_free_shard_index()
        self._queue: deque[_Batch | threading.Event | None] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"metastore-writer-rank{self.rank}", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest as last written (a copy is not made: do not modify)."""
        return self._manifest

    def write(
        self,
        records: Sequence[LayerRecord],
        *,
        sample_ids: ArrayLike,
        step: int,
        capture_point: str = "train",
        epoch: int = 0,
        micro_batch: int = 0,
        labels: ArrayLike | None = None,
        losses: ArrayLike | None = None,
        predictions: ArrayLike | None = None,
        lr: float | None = None,
    ) -> None:
        """Queue one batch: its records and one metadata entry per sample (waits if the queue is full).

        After a disk error with ``on_error="warn"`` this drops the batch (see :attr:`stopped`).
        """
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError("this StoreWriter is closed; open a new one to write more")
        if self.stopped is not None:
            self.dropped_samples += int(torch.as_tensor(sample_ids).numel())
            return
        if not isinstance(capture_point, str) or not capture_point.strip():
            raise ValueError(f"capture_point must be a non-empty name such as 'train'; got {capture_point!r}")
        ids = torch.as_tensor(sample_ids).detach().cpu().long().reshape(-1).clone()
        size = ids.shape[0]
        meta = {"sample_id": ids}
        columns = (
            ("label", "labels", labels, None),
            ("loss", "losses", losses, torch.float32),
            ("prediction", "predictions", predictions, None),
        )
        for name, argument, values, dtype in columns:
            column = _column(argument, values, size, dtype)
            if column is not None:
                meta[name] = column
        records = list(records)
        self._check_records(records, size)
        info = {
            "capture_point": capture_point,
            "step": int(step),
            "epoch": int(epoch),
            "micro_batch": int(micro_batch),
            "rank": self.rank,
            "size": size,
            "lr": None if lr is None else float(lr),
        }
        nbytes = sum(r.nbytes for r in records) + sum(t.numel() * t.element_size() for t in meta.values())
        self._put(_Batch(records, meta, info, nbytes), nbytes)

    def flush(self) -> None:
        """Block until everything queued so far is on disk and listed in the manifest."""
        done = threading.Event()
        self._put(done, 0)
        while not done.wait(0.05):
            self._raise_if_failed()
            if not self._thread.is_alive():
                break
        self._raise_if_failed()

    def close(self) -> None:
        """Write what is queued, stop the thread. Safe to call twice."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            with self._cond:
                self._queue.append(None)
                self._cond.notify_all()
            self._thread.join()

    # -- caller side ---------------------------------------------------------------------

    def _check_records(self, records: list[LayerRecord], size: int) -> None:
        """Check every record of a batch, then register its new layers: a rejected batch leaves no trace."""
        new: dict[str, dict[str, Any]] = {}
        for record in records:
            if record.batch_size != size:
                raise ValueError(
                    f"record of layer '{record.layer}' holds {record.batch_size} samples but {size} sample ids "
                    "were given; pass one id per sample of the batch"
                )
            layer = {
                "params": dict(record.params),
                "param_shapes": {k: list(v) for k, v in record.param_shapes.items()},
                "layout": record.layout,
            }
            known = self._manifest["layers"].get(record.layer) or new.setdefault(record.layer, layer)
            if known != layer:
                raise ValueError(
                    f"layer '{record.layer}' changed since it was first stored ({known} vs {layer}); "
                    "write a changed model to a new store directory"
                )
        if new:
            with self._cond:  # the writer thread serializes the manifest under this lock
                self._manifest["layers"].update(new)

    def _put(self, item: _Batch | threading.Event, nbytes: int) -> None:
        start = time.perf_counter()
        with self._cond:
            while self._queued_bytes > 0 and self._queued_bytes + nbytes > self.queue_bytes and self._error is None:
                self._cond.notify_all()
                self._cond.wait(0.1)
            self._queue.append(item)
            self._queued_bytes += nbytes
            self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, self._queued_bytes)
            if not isinstance(item, _Batch) or self._queued_bytes >= min(self.shard_bytes, self.queue_bytes // 2):
                # batches wait for a shard's worth: waking the thread per batch costs training time
                self._cond.notify_all()
        self.stats.wait_seconds += time.perf_counter() - start
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.stopped is not None and not self._warned:
            self._warned = True
            shards = self._manifest["shards"]
            warnings.warn(
                f"the gradient store writer for {self.path} STOPPED CAPTURING after a disk error "
                f"({self.stopped}); the store keeps the {len(shards)} shard(s) and "
                f"{sum(s['rows'] for s in shards)} sample(s) listed in {mf.manifest_name(self.rank)}; "
                f"{self.dropped_samples} sample(s) in flight were lost and later batches are dropped "
                "(pass on_error='raise' to StoreWriter to fail instead)",
                RuntimeWarning,
                stacklevel=3,
            )
        if self._error is not None:
            raise RuntimeError(f"the gradient store writer for {self.path} failed: {self._error!r}") from self._error

    # -- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        # this thread's torch ops (encoding) run single-threaded: sharing the training thread's
        # intra-op threads oversubscribes the cores and slows the training step (per-thread setting)
        torch.set_num_threads(1)
        buffer = ShardBuffer()  # reused by every shard; freed when the thread ends
        pending: list[_Batch] = []  # batches of the shard being built, not encoded yet
        pending_bytes = 0  # their encoded size
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
            if item is None:
                return
            try:
                if self.stopped is not None or self._error is not None:  # drop what is left
                    if isinstance(item, _Batch):
                        self.dropped_samples += item.info["size"]
                    else:
                        item.set()
                    continue
                if isinstance(item, threading.Event):
                    if pending:
                        self._write_shard(pending, buffer)
                    pending, pending_bytes = [], 0
                    item.set()
                    continue
                item.records = [replace(r, tensors={k: t.cpu() for k, t in r.tensors.items()}) for r in item.records]
                pending.append(item)
                pending_bytes += sum(encoded_nbytes(t, self.encoding) for r in item.records for t in r.tensors.values())
                pending_bytes += sum(t.numel() * t.element_size() for t in item.meta.values())
                self.stats.peak_pending_bytes = max(self.stats.peak_pending_bytes, pending_bytes)
                self.stats.dense_bytes += sum(r.dense_nbytes for r in item.records)
                if pending_bytes >= self.shard_bytes:
                    self._write_shard(pending, buffer)
                    pending, pending_bytes = [], 0
            except BaseException as exc:  # surfaced on the training thread by the next call
                if isinstance(exc, OSError) and self.on_error == "warn":
                    self.stopped = exc
                else:
                    self._error = exc
                self.dropped_samples += sum(b.info["size"] for b in pending)
                pending, pending_bytes = [], 0
                if isinstance(item, threading.Event):
                    item.set()
            finally:
                with self._cond:
                    self._queued_bytes -= item.nbytes if isinstance(item, _Batch) else 0
                    self._cond.notify_all()

    @staticmethod
    def _record_info(record: LayerRecord) -> dict[str, Any]:
        rows = record.batch_size if record.kind == "dense" else int(record.tensors["sample"].shape[0])
        return {
            "layer": record.layer,
            "kind": record.kind,
            "rows": rows,
            "bytes": record.nbytes,
            "dense_bytes": record.dense_nbytes,
        }

    def _write_shard(self, pending: list[_Batch], buffer: ShardBuffer) -> None:
        batches = [b.info | {"records": [self._record_info(r) for r in b.records]} for b in pending]
        name = mf.shard_name(self.rank, self._next_shard)
        final, tmp = self.path / name, self.path / (name + ".tmp")
        try:
            metadata = {"format": mf.FORMAT, "encoding": self.encoding}
            size, sha256 = write_shard(tmp, [(b.records, b.meta) for b in pending], self.encoding, metadata, buffer)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a partial file on a full disk
            raise
        ids = [int(v) for b in pending if (t := b.meta["sample_id"]).numel() for v in (t.min(), t.max())]
        steps = [b["step"] for b in batches]
        entry = {
            "file": name,
            "bytes": size,
            "sha256": sha256,
            "encoding": self.encoding,
            "rows": sum(b["size"] for b in batches),
            "steps": [min(steps), max(steps)],
            "sample_ids": [min(ids), max(ids)] if ids else [],
            "batches": batches,
        }
        with self._cond:  # the training thread may be registering new layers
            manifest = {
                **self._manifest,
                "layers": dict(self._manifest["layers"]),
                "shards": [*self._manifest["shards"], entry],
            }
        try:
            mf.fsync_dir(self.path)
            mf.write_manifest(self.path, manifest)
        except BaseException:
            if not self._listed_on_disk(name):
                final.unlink(missing_ok=True)  # never listed: free its space; the last manifest stays valid
            raise
        with self._cond:
            self._manifest["shards"].append(entry)
        self._next_shard += 1
        self.stats.shards += 1
        self.stats.batches += len(batches)
        self.stats.bytes_written += entry["bytes"]
        self.stats.files.append(name)

    def _listed_on_disk(self, name: str) -> bool:
        """Whether the rank's manifest on disk lists ``name`` (True when it cannot be read: keep the file)."""
        try:
            return any(
                s.get("file") == name for s in mf.load_manifest(self.path / mf.manifest_name(self.rank))["shards"]
            )
        except Exception:  # noqa: BLE001 - in doubt, keep the shard
            return True

    # -- opening -------------------------------------------------------------------------

    def _open_manifest(self, config: dict[str, Any]) -> dict[str, Any]:
        existing = self.path / mf.manifest_name(self.rank)
        for stale in [*self.path.glob(f"rank{self.rank}-*.tmp"), self.path / (mf.manifest_name(self.rank) + ".tmp")]:
            stale.unlink(missing_ok=True)
        if existing.exists():
            manifest = mf.load_manifest(existing)
            manifest["config"] = {**manifest.get("config", {}), **config}
            return manifest
        manifest = mf.new_manifest(self.rank, config)
        mf.write_manifest(self.path, manifest)
        return manifest

    def _first_free_shard_index(self) -> int:
        used = [int(p.name.split("-")[1].split(".")[0]) for p in self.path.glob(f"rank{self.rank}-*.safetensors")]
        return max(used, default=-1) + 1
