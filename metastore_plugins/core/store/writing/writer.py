"""``StoreWriter``: queues records to a background thread that writes whole safetensors shards.

Example::

    with StoreWriter("runs/demo/store", rank=0) as writer:
        with CaptureSession(model) as session:
            loss_fn(model(x), y).backward()
        writer.write(session.factors(), BatchMeta(ids, step=0, labels=y, losses=per_sample_loss))

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
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

from metastore_plugins.core.errors import ConfigError, ConfigTypeError, StateError, StoreError, WriterError
from metastore_plugins.core.records import BatchMeta, LayerRecord
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.encoding import DEFAULT_ENCODING, Encoding, check_encoding, encoded_nbytes
from metastore_plugins.core.store.shards.entries import new_entry
from metastore_plugins.core.store.shards.index_writer import RankIndexWriter
from metastore_plugins.core.store.shards.journal import journal_name
from metastore_plugins.core.store.shards.shardfile import ShardBuffer, Written, write_shard
from metastore_plugins.core.store.shards.shardinfo import describe
from metastore_plugins.core.store.writing.writer_batches import Batch, WriterStats, record_info, shard_keys
from metastore_plugins.core.store.writing.writer_life import WriterLife, closed, opened


class _SaveConfig(threading.Event):
    """A request to write the manifest's config now, without a shard (set once written)."""


class StoreWriter:
    """Writes records and per-sample metadata of one process rank to a run directory.

    Args:
        path: the run directory (created). An existing store of the same rank is continued.
        rank: the process rank; each rank writes its own shards and manifest.
        encoding: ``"fp32"``, ``"fp16"`` (default), ``"bf16"`` or ``"int8"``, see
            :mod:`~metastore_plugins.core.store.shards.encoding`.
        queue_bytes: the most record bytes waiting for the writer thread.
        shard_bytes: a shard is written once its encoded tensors reach this size.
        flush_seconds: what the writer holds is also written, as a (smaller) shard, once
            the oldest batch not on disk was queued ``flush_seconds / 2`` ago: a crash loses
            at most the last ``flush_seconds`` of batches while a shard takes less than half
            that to write. ``None``: only full shards, ``flush()`` and ``close()`` write.
        config: the run's configuration, kept in the manifest.
        on_error: what an ``OSError`` while writing a shard or the manifest (a full disk)
            does. ``"warn"`` (default): capture stops, later ``write()`` calls drop their
            data, and the next ``write``/``flush``/``close`` warns once, naming the directory
            and what the store kept; training goes on. ``"raise"``: the next
            ``write``/``flush``/``close`` raises ``RuntimeError``. Either way the shards already
            listed and the last manifest stay valid, the partial file is removed, and the rank's run
            log records that the store is incomplete from the first step not stored
            (:mod:`~metastore_plugins.core.store.writing.run_log`).
        on_shard: called on the writer thread with each shard's file name once it is listed (the write
            side of the nearest-gradient index queues its part there). It must return at once; what it
            raises is kept in :attr:`on_shard_error` (the first) and never stops capture.
        run_start: the step the run this writer captures starts at: its start and how it ended
            (:meth:`close`) go to the run log (:attr:`life`, a :class:`~.writer_life.WriterLife`). ``None``: only
            an error that stops capture is recorded. A writer still open when the process exits is closed then.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int = 0,
        encoding: Encoding = DEFAULT_ENCODING,
        queue_bytes: int = 256 * 2**20,
        shard_bytes: int = 64 * 2**20,
        flush_seconds: float | None = 10.0,
        config: dict[str, Any] | None = None,
        on_error: Literal["warn", "raise"] = "warn",
        on_shard: Callable[[str], object] | None = None,
        run_start: int | None = None,
    ) -> None:
        if queue_bytes <= 0 or shard_bytes <= 0:
            raise ConfigError("queue_bytes and shard_bytes must be positive byte counts")
        seconds = isinstance(flush_seconds, (int, float)) and not isinstance(flush_seconds, bool)
        if flush_seconds is not None and not (seconds and 0 < flush_seconds < float("inf")):
            raise ConfigError(
                f"flush_seconds must be a positive, finite number of seconds, or None; got {flush_seconds!r}"
            )
        self.flush_seconds = None if flush_seconds is None else float(flush_seconds)
        if on_error not in ("warn", "raise"):
            raise ConfigError(f"on_error must be 'warn' or 'raise'; got {on_error!r}")
        self.on_error = on_error
        self.on_shard = on_shard
        self.on_shard_error: Exception | None = None
        self.stopped: OSError | None = None  # the disk error that stopped capture (on_error="warn")
        self._warned = False
        self.path = Path(path)
        self.rank = int(rank)
        self.encoding = check_encoding(encoding)
        self.queue_bytes, self.shard_bytes = int(queue_bytes), int(shard_bytes)
        self.stats = WriterStats()
        self.path.mkdir(parents=True, exist_ok=True)
        self._index = RankIndexWriter(self.path, self.rank, config or {})
        self._queue: deque[tuple[float, Batch | threading.Event | None]] = deque()  # (time.monotonic() queued, item)
        self._queued_bytes = 0
        self._idle = False  # the writer thread waits with nothing unwritten: the next batch wakes it (starts the timer)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        try:
            self.life = WriterLife(self.path, self.rank, run_start)  # its run log
        except BaseException:
            self._index.close()
            raise
        opened(self)
        self._thread = threading.Thread(target=self._run, name=f"metastore-writer-rank{self.rank}", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        self.close(error)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def manifest(self) -> dict[str, Any]:
        """The rank's manifest: config and layers (a copy is not made: do not modify)."""
        return self._index.manifest

    def write(self, records: Sequence[LayerRecord], meta: BatchMeta | None = None, /, **fields: Any) -> None:
        """Queue one batch: its records and one metadata entry per sample (waits if the queue is full).

        ``meta``: the batch's :class:`~metastore_plugins.core.records.BatchMeta`; or its fields as
        keywords (``sample_ids=ids, step=3, labels=y``).

        After a disk error with ``on_error="warn"`` this drops the batch (see :attr:`stopped`).
        """
        if meta is None:
            meta = BatchMeta(**fields)
        elif fields:
            raise ConfigTypeError(
                f"write() takes a BatchMeta or its fields as keywords, not both; got {sorted(fields)}"
            )
        self._raise_if_failed()
        if self._closed:
            raise StateError("this StoreWriter is closed; open a new one to write more")
        if self.stopped is not None:
            self.life.lose(int(meta.step), int(torch.as_tensor(meta.sample_ids).numel()), self.stopped)
            return
        if not isinstance(meta.capture_point, str) or not meta.capture_point.strip():
            raise ConfigError(f"capture_point must be a non-empty name such as 'train'; got {meta.capture_point!r}")
        columns = meta.columns()
        size = columns["sample_id"].shape[0]
        records = list(records)
        self._check_records(records, size)
        info = {
            "capture_point": meta.capture_point,
            "step": int(meta.step),
            "epoch": int(meta.epoch),
            "micro_batch": int(meta.micro_batch),
            "rank": self.rank,
            "size": size,
            "lr": None if meta.lr is None else float(meta.lr),
        }
        nbytes = sum(r.nbytes for r in records) + sum(t.numel() * t.element_size() for t in columns.values())
        self._put(Batch(records, columns, info, nbytes), nbytes)

    def update_config(self, changes: dict[str, Any], *, save: bool = False) -> None:
        """Merge ``changes`` into the manifest's config (written with the next shard, or when closing).

        ``save``: have the writer thread write the manifest now, without a shard and without waiting for it
        (the capture plan, recorded when the run starts).
        """
        self._index.update_config(changes)
        if save:
            self._put(_SaveConfig(), 0)

    def flush(self, wait: bool = True) -> None:
        """Write everything queued so far as a shard; with ``wait``, block until it is on disk and listed.

        ``wait=False`` only asks the writer thread for the shard and returns at once.
        """
        done = threading.Event()
        self._put(done, 0)
        while wait and not done.wait(0.05):
            self._raise_if_failed()
            if not self._thread.is_alive():
                break
        self._raise_if_failed()

    def close(self, error: BaseException | None = None, *, how: str | None = None) -> None:
        """Write what is queued, stop the thread. Safe to call twice.

        ``error``: the exception that ends the run (None: it finished); ``how`` says it in the run log's words
        instead (:data:`~metastore_plugins.core.store.writing.run_log.HOW`).
        """
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            with self._cond:
                self._queue.append((time.monotonic(), None))
                self._cond.notify_all()
            self._thread.join()
            closed(self)
            try:
                self.life.end(how, error)
            finally:
                self._index.close()

    @property
    def failed(self) -> bool:
        """Whether the writer thread failed (its error is raised by the next ``write``/``flush``/``close``)."""
        return self._error is not None

    # -- caller side ---------------------------------------------------------------------

    def _check_records(self, records: list[LayerRecord], size: int) -> None:
        """Check every record of a batch, then register its new layers: a rejected batch leaves no trace."""
        new: dict[str, dict[str, Any]] = {}
        for record in records:
            if record.batch_size != size:
                raise ConfigError(
                    f"record of layer '{record.layer}' holds {record.batch_size} samples but {size} sample ids "
                    "were given; pass one id per sample of the batch"
                )
            layer = {
                "params": dict(record.params),
                "param_shapes": {k: list(v) for k, v in record.param_shapes.items()},
                "layout": record.layout,
            }
            known = self._index.layers.get(record.layer) or new.setdefault(record.layer, layer)
            if known != layer:
                raise StoreError(
                    f"layer '{record.layer}' changed since it was first stored ({known} vs {layer}); "
                    "write a changed model to a new store directory"
                )
        if new:
            self._index.register_layers(new)

    def _put(self, item: Batch | threading.Event, nbytes: int) -> None:
        start, queued = time.perf_counter(), time.monotonic()  # the timer counts from here, waiting for room included
        with self._cond:
            while self._queued_bytes > 0 and self._queued_bytes + nbytes > self.queue_bytes and self._error is None:
                self._cond.notify_all()
                self._cond.wait(0.1)
            self._queue.append((queued, item))
            self._queued_bytes += nbytes
            self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, self._queued_bytes)
            if (
                not isinstance(item, Batch)
                or self._idle
                or self._queued_bytes >= min(self.shard_bytes, self.queue_bytes // 2)
            ):
                # batches wait for a shard's worth or the timer: waking the thread per batch costs training
                # time. An idle thread is woken by the first batch only, to start the timer (_run).
                self._cond.notify_all()
        self.stats.wait_seconds += time.perf_counter() - start
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.stopped is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"the gradient store writer for {self.path} STOPPED CAPTURING after a disk error "
                f"({self.stopped}); the store keeps the {self._index.shards} shard(s) and "
                f"{self._index.samples} sample(s) listed in {journal_name(self.rank)}; "
                f"{self.life.dropped_samples} sample(s) in flight were lost and later batches are dropped"
                f"{self.life.note()} (pass on_error='raise' to StoreWriter to fail instead)",
                RuntimeWarning,
                stacklevel=3,
            )
        if self._error is not None:
            raise WriterError(f"the gradient store writer for {self.path} failed: {self._error!r}") from self._error

    # -- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        # this thread's torch ops (encoding) run single-threaded: sharing the training thread's
        # intra-op threads oversubscribes the cores and slows the training step (per-thread setting)
        torch.set_num_threads(1)
        buffer = ShardBuffer()  # reused by every shard; freed when the thread ends
        pending: list[Batch] = []  # batches of the shard being built, not encoded yet
        pending_bytes = 0  # their encoded size
        pending_since: float | None = None  # when pending[0] was queued (time.monotonic())
        timer: threading.Event | None = None  # the flush request the timer queued, not reached yet
        half = None if self.flush_seconds is None else self.flush_seconds / 2
        while True:
            with self._cond:
                while True:
                    # the oldest batch not on disk: the first pending one, else the first queued one
                    first = next((t for t, queued in self._queue if isinstance(queued, Batch)), None)
                    oldest = first if pending_since is None else pending_since
                    left = None if half is None or oldest is None else oldest + half - time.monotonic()
                    if left is not None and left <= 0 and timer is None:  # due: write all it holds now
                        timer = threading.Event()
                        self._queue.append((time.monotonic(), timer))
                    if self._queue:
                        break
                    self._idle = half is not None and left is None  # then the next batch wakes this thread
                    self._cond.wait(left)  # training wakes it only for a shard's worth, a flush or close
                    self._idle = False
                since, item = self._queue.popleft()
            if item is None:
                return
            by_timer = item is timer
            if by_timer:
                timer = None
            try:
                if self.stopped is not None or self._error is not None:  # drop what is left
                    if isinstance(item, Batch):
                        self.life.lose(item.info["step"], item.info["size"], self.stopped or self._error)
                    else:
                        item.set()
                    continue
                if isinstance(item, _SaveConfig):
                    self._index.save_config()
                    item.set()
                    continue
                if isinstance(item, threading.Event):  # flush(), or the timer
                    if pending:
                        self._write_shard(pending, buffer)
                        self.stats.timer_shards += int(by_timer)
                    pending, pending_bytes, pending_since = [], 0, None
                    item.set()
                    continue
                item.records = [replace(r, tensors={k: t.cpu() for k, t in r.tensors.items()}) for r in item.records]
                pending_since = since if not pending else pending_since
                pending.append(item)
                pending_bytes += sum(encoded_nbytes(t, self.encoding) for r in item.records for t in r.tensors.values())
                pending_bytes += sum(t.numel() * t.element_size() for t in item.meta.values())
                self.stats.peak_pending_bytes = max(self.stats.peak_pending_bytes, pending_bytes)
                self.stats.dense_bytes += sum(r.dense_nbytes for r in item.records)
                if pending_bytes >= self.shard_bytes:
                    self._write_shard(pending, buffer)
                    pending, pending_bytes, pending_since = [], 0, None
            except BaseException as exc:  # surfaced on the training thread by the next call
                if isinstance(exc, OSError) and self.on_error == "warn":
                    self.stopped = exc
                else:
                    self._error = exc
                if pending:
                    self.life.lose(min(b.info["step"] for b in pending), sum(b.info["size"] for b in pending), exc)
                pending, pending_bytes, pending_since = [], 0, None
                if isinstance(item, threading.Event):
                    item.set()
            finally:
                with self._cond:
                    self._queued_bytes -= item.nbytes if isinstance(item, Batch) else 0
                    self._cond.notify_all()

    def _write_shard(self, pending: list[Batch], buffer: ShardBuffer) -> None:
        """Write ``pending`` as the next shard, whole on disk, then list it with one journal line."""
        name = mf.shard_name(self.rank, self._index.next_shard)
        files = self._index.files
        written: list[Written] = []
        batches = [(b.info | {"records": [record_info(r) for r in b.records]}, b.meta) for b in pending]
        entry = new_entry(name, 0, "", self.encoding, self.rank, batches)
        metadata = {"format": mf.FORMAT, "encoding": self.encoding}
        metadata.update(describe(entry, self._index.layers, shard_keys(pending)))  # what repair rebuilds its line from

        def write(handle: BinaryIO) -> None:
            written.append(write_shard(handle, [(b.records, b.meta) for b in pending], self.encoding, metadata, buffer))

        files.atomic_write(name, write)  # a partial temporary (full disk) is removed
        entry.bytes, entry.sha256, entry.xxh3_128 = written[0]
        try:
            self._index.append(entry)
        except BaseException:
            files.remove(name, missing_ok=True)  # never listed: free its space; the journal stays valid
            raise
        self.stats.shards += 1
        self.life.stored_step = max([self.life.stored_step or 0, *(b.info["step"] for b in pending)])
        self.stats.batches += len(batches)
        self.stats.bytes_written += entry.bytes
        self.stats.files.append(name)
        if self.on_shard is not None:
            try:
                self.on_shard(name)
            except Exception as exc:  # the shard is listed: a failing listener never stops capture
                self.on_shard_error = self.on_shard_error or exc
