"""The write side of the nearest-gradient index: each new shard's parts, built while the run goes.

A :class:`PartBuilder` is handed each shard's name by the writer once the shard is listed
(``StoreWriter(on_shard=builder.shard_written)``, wired by :class:`~metastore_plugins.core.training.run.RunCapture`)
and builds, on its own thread (one torch thread, the lowest CPU priority), the shard's part of the
index a default query opens: per capture point the shard holds, the index of ``(capture point,
default_dim, seed 0, the store's layers in order)``, the part written by :func:`.index_files.encode_part`
from :func:`.index_files.build_piece`, the very functions a query-time build calls, so its bytes are those
a query would write. The part is then listed in the manifest under its lock (:func:`~metastore_plugins.core.
store.vector_files.add_parts`). A later query (``--index auto|build``) only builds what is missing and the
search structure.

The store (layer 2) knows nothing of this: it calls a callable. The writer thread only queues a name, so a
shard is never delayed nor lost by a part; a part that fails (a shard compacted away meanwhile, a full
disk) is left to the next query, its reason kept in :attr:`PartBuilder.problems`. After compaction the
merged shards' parts are the concatenation of their members' sound parts (:func:`merge_parts`: a shard's
rows are sketched batch by batch, so the merged shard's part holds the same numbers), checked against the
merged shard's sample ids and learning rates.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from metastore_plugins.core.analysis.index_files import build_piece, default_dim, encode_part, index_head, load_part
from metastore_plugins.core.analysis.sketches import sketch_layers
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import Selection, StoreError, StoreReader
from metastore_plugins.core.store import vector_files as vf

#: One merged shard of a compaction: its file, and the ``(file, sha256)`` of the shards it holds, in order.
Group = tuple[str, list[tuple[str, str]]]


def _shard_selections(store: StoreReader, shard: str) -> list[tuple[str, Selection]]:
    """``(capture point, its batches in ``shard``)`` for each capture point the shard holds."""
    points = dict.fromkeys(str(ref.info["capture_point"]) for ref in store.batch_refs() if ref.file.name == shard)
    order, found = sketch_layers(store, None), []
    for point in points:
        selection = store.select(point, layers=order)
        rows = [row for row, ref in zip(selection.batch_rows.tolist(), selection.refs) if ref.file.name == shard]
        found.append((point, replace(selection, batch_rows=np.asarray(rows, dtype=np.int64))))
    return found


def build_shard_parts(
    path: str | os.PathLike[str], shard: str, dims: dict[str, int] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[str]:
    """Write and list the parts of ``shard`` (a listed shard's file name) of the default index of each capture
    point it holds; returns the part files. ``dims``: capture point -> its :func:`.index_files.default_dim`, filled
    on first use (it reads the capture point's first batch)."""
    store, dims = StoreReader(path), {} if dims is None else dims
    try:
        sha, order, written = store.shard_sha256(shard), sketch_layers(store, None), []
    except KeyError:
        raise StoreError(f"{shard} is no longer listed (compacted or removed)") from None
    for point, selection in _shard_selections(store, shard):
        if point not in dims:
            dims[point] = default_dim(store, point, order)
        key, head = index_head(point, dims[point], 0, order)
        entry, data = encode_part(build_piece(selection, head, max_bytes), head, key, shard, sha)
        vf.write(store.path, entry["file"], data)
        vf.remove(store.path, vf.add_parts(store.path, key, head, [entry]))
        written.append(entry["file"])
    return written


def merge_parts(path: str | os.PathLike[str], groups: Sequence[Group]) -> tuple[list[str], list[str]]:
    """The parts of compaction's merged shards, from their members' parts; ``(files written, problems)``.

    For each index (manifest) and merged shard: the rows of its members' listed parts that are bound to the
    sha256 the members had when merged, and sound, concatenated, if their sample ids and learning rates are
    the merged shard's rows of the index's capture point (else nothing is written: a member without a part,
    and the next query builds the merged shard's part). The members' parts are then delisted and removed.
    """
    store, written, problems = StoreReader(path), [], []
    for key in vf.manifest_keys(store.path):
        try:
            manifest = vf.read_manifest(store.path, key)
        except StoreError as exc:
            problems.append(str(exc))
            continue
        if manifest is None:
            continue
        head = {k: manifest.get(k) for k in ("format", "version", "capture_point", "dim", "seed", "layers")}
        listed = {str(p.get("shard")): p for p in manifest["parts"]}
        for merged, members in groups:
            found = [(e, sha) for name, sha in members if (e := listed.get(name)) and e.get("shard_sha256") == sha]
            if not found:
                continue  # none of its shards has a part of this index (or held its capture point)
            part = _merged_piece(store, head, merged, found)
            if isinstance(part, str):
                problems.append(part)
                continue
            entry, data = encode_part(part, head, key, merged, store.shard_sha256(merged))
            vf.write(store.path, entry["file"], data)
            vf.remove(store.path, vf.add_parts(store.path, key, head, [entry], drop=[n for n, _ in members]))
            written.append(entry["file"])
    return written, problems


def _merged_piece(
    store: StoreReader, head: dict[str, object], merged: str, members: list[tuple[dict[str, object], str]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | str:
    """The members' rows concatenated, or why not (one line)."""
    said: list[str] = []
    pieces = [load_part(store, e, head, sha, int(str(e.get("rows", 0))), said.append) for e, sha in members]
    if said or any(p is None for p in pieces):
        return f"{merged}: its part is left to the next query ({said[0] if said else 'a member part is unusable'})"
    ids = np.concatenate([p[0] for p in pieces if p is not None])  # (n,)
    lr = np.concatenate([p[1] for p in pieces if p is not None])  # (n,)
    vectors = np.concatenate([p[2] for p in pieces if p is not None])  # (n, D)
    selection = dict(_shard_selections(store, merged)).get(str(head["capture_point"]))
    want_lr = np.concatenate([np.full(r.size, r.lr_weight) for r in selection.refs]) if selection else np.zeros(0)
    if selection is None or not np.array_equal(ids, selection.sample_ids()) or not np.array_equal(lr, want_lr):
        return f"{merged}: its part is left to the next query (its members' parts do not hold its rows)"
    return ids, lr, vectors


class PartBuilder:
    """Builds each listed shard's index parts on a background thread, so that the index grows as the run goes.

    Example::

        builder = PartBuilder("runs/demo/store")
        writer = StoreWriter("runs/demo/store", on_shard=builder.shard_written)
        ...  # training; at the end: writer.close(); builder.close(compaction_report.groups)
    """

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self.written: list[str] = []  # part files written
        self.problems: list[str] = []  # one line per part left to the next query
        self.seconds = 0.0  # wall seconds spent building (on the builder's thread)
        self._jobs: queue.Queue[str | list[Group] | threading.Event | None] = queue.Queue()
        self._dims: dict[str, int] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="metastore-index-parts", daemon=True)
        self._thread.start()

    def shard_written(self, shard: str) -> None:
        """Queue ``shard``'s parts (returns at once; the writer's ``on_shard``)."""
        if not self._closed:
            self._jobs.put(shard)

    def drain(self) -> None:
        """Wait until every part queued so far is built (or left to the next query)."""
        if self._thread.is_alive():
            done = threading.Event()
            self._jobs.put(done)
            done.wait()

    def close(self, groups: Sequence[Group] = ()) -> None:
        """Build what is queued, then the parts of ``groups`` (compaction's merged shards), and stop. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if groups:
            self._jobs.put(list(groups))
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        torch.set_num_threads(1)  # beside the training thread's intra-op threads, never in their way
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread only
        except (AttributeError, OSError):  # pragma: no cover - elsewhere: the default priority
            pass
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            start = time.perf_counter()
            try:
                if isinstance(job, str):
                    self.written += build_shard_parts(self.path, job, self._dims, self.max_bytes)
                else:
                    written, problems = merge_parts(self.path, job)
                    self.written, self.problems = self.written + written, self.problems + problems
            except Exception as exc:  # a cache: what fails is left to the next query, never to training
                what = job if isinstance(job, str) else "the compacted shards"
                self.problems.append(f"{what}: its index part is left to the next query ({exc})".splitlines()[0])
            self.seconds += time.perf_counter() - start
