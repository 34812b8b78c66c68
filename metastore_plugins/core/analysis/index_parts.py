"""The write side of the nearest-gradient index: each new shard's parts, built while the run goes.

A :class:`PartBuilder` is handed each shard's name by the writer once the shard is listed
(``StoreWriter(on_shard=builder.shard_written)``, wired by :class:`~metastore_plugins.core.training.run.RunCapture`)
and has a child process (:func:`serve`: one torch thread, the lowest CPU priority) build the shard's part of
the index a default query opens: per capture point the shard holds, the index of ``(capture point,
default_dim, seed 0, the store's layers in order)``, written by :func:`.index_files.encode_part` from
:func:`.index_files.build_piece`, the very functions a query-time build calls, so its bytes are those a query
would write. The part is then listed in the manifest under its lock (:func:`~metastore_plugins.core.store.
vector_files.add_parts`). A later query (``--index auto|build``) only builds what is missing and the search
structure.

The store (layer 2) knows nothing of this: it calls a callable. The writer thread only queues a name, so a
shard is never delayed nor lost by a part; a part that fails (a shard compacted away meanwhile, a full
disk, the child killed) is left to the next query, its reason kept in :attr:`PartBuilder.problems`. After
compaction the merged shards' parts are the concatenation of their members' sound parts (:func:`merge_parts`:
a shard's rows are sketched batch by batch, so the merged shard's part holds the same numbers), checked
against the merged shard's sample ids and learning rates.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

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


def serve(path: str, max_bytes: int, jobs: IO[str], answers: IO[str]) -> None:
    """The builder process: one JSON job a line (``{"shard": name}``, ``{"groups": [...]}`` or ``{}``: a sync),
    one JSON answer a line (``{"written", "problems", "seconds"}``), until its input ends."""
    torch.set_num_threads(1)
    try:
        os.nice(19)  # below training, whatever the cores
    except (AttributeError, OSError):  # pragma: no cover - no nice(): the default priority
        pass
    dims: dict[str, int] = {}
    for line in jobs:
        job, start = json.loads(line), time.perf_counter()
        written: list[str] = []
        problems: list[str] = []
        try:
            if "shard" in job:
                written = build_shard_parts(path, str(job["shard"]), dims, max_bytes)
            elif "groups" in job:
                groups = [(str(m), [(str(f), str(sha)) for f, sha in members]) for m, members in job["groups"]]
                written, problems = merge_parts(path, groups)
        except Exception as exc:  # a cache: what fails is left to the next query, never to training
            what = job.get("shard", "the compacted shards")
            problems.append(f"{what}: its index part is left to the next query ({exc})".splitlines()[0])
        answers.write(json.dumps({"written": written, "problems": problems, "seconds": time.perf_counter() - start}))
        answers.write("\n")
        answers.flush()


class PartBuilder:
    """Builds each listed shard's index parts in a child process, so that the index grows as the run goes.

    A process, not a thread: a thread of the training process would take the interpreter's lock from the
    training loop for its Python work (measured: +14% on a CNN step with 14 idle cores). The child runs
    :func:`serve` at the lowest priority with one torch thread; a thread of this process hands it the jobs
    in order and waits for each answer (blocked in a pipe, never holding the lock). If the child ends, the
    jobs left are dropped (one line in :attr:`problems`): the next query builds those parts. ``command``:
    how to start the child (tests start it through a wrapper); it is given the store and ``max_bytes``.

    Example::

        builder = PartBuilder("runs/demo/store")
        writer = StoreWriter("runs/demo/store", on_shard=builder.shard_written)
        ...  # training; at the end: writer.close(); builder.close(compaction_report.groups)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        command: Sequence[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.written: list[str] = []  # part files written
        self.problems: list[str] = []  # one line per part left to the next query
        self.seconds = 0.0  # wall seconds the child spent on its jobs
        argv = [*(command or [sys.executable, "-m", __name__]), str(self.path), str(int(max_bytes))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._child = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self._jobs: queue.Queue[dict[str, Any] | threading.Event | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._feed, name="metastore-index-parts", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        """The child process's id."""
        return self._child.pid

    def shard_written(self, shard: str) -> None:
        """Queue ``shard``'s parts (returns at once; the writer's ``on_shard``)."""
        if not self._closed:
            self._jobs.put({"shard": shard})

    def drain(self) -> None:
        """Wait until every part queued so far is built (or left to the next query)."""
        done = threading.Event()
        self._jobs.put(done)
        while not done.wait(0.05):
            if not self._thread.is_alive():
                return

    def close(self, groups: Sequence[Group] = ()) -> None:
        """Build what is queued, then the parts of ``groups`` (compaction's merged shards), and stop. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if groups:
            self._jobs.put({"groups": [[merged, [list(m) for m in members]] for merged, members in groups]})
        self._jobs.put(None)
        self._thread.join()

    def _feed(self) -> None:
        child, alive = self._child, True
        assert child.stdin is not None and child.stdout is not None
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            if not alive:
                continue
            try:
                child.stdin.write(json.dumps(job) + "\n")
                child.stdin.flush()
                answer = json.loads(child.stdout.readline() or "null")
            except (OSError, ValueError):
                answer = None
            if not isinstance(answer, dict):
                alive = False
                try:
                    code: int | None = child.wait(timeout=10)  # its output ended: it is ending
                except subprocess.TimeoutExpired:
                    code = None
                self.problems.append(
                    f"the index part builder (process {child.pid}) ended (exit code {code}); the parts of the "
                    "shards written since are left to the next query"
                )
                continue
            self.written += answer["written"]
            self.problems += answer["problems"]
            self.seconds += answer["seconds"]
        for stream in (child.stdin, child.stdout):
            try:
                stream.close()
            except OSError:
                pass
        child.wait()


def main(argv: Sequence[str] | None = None) -> None:
    """The child's entry point: ``python -m metastore_plugins.core.analysis.index_parts STORE MAX_BYTES``."""
    path, max_bytes = argv or sys.argv[1:]
    answers, sys.stdout = sys.stdout, sys.stderr  # what anything else prints never mixes with the answers
    serve(path, int(max_bytes), sys.stdin, answers)


if __name__ == "__main__":
    main()
