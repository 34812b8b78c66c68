"""The write side of the nearest-gradient index: a rank's parts, built once its last training step is done.

:class:`~metastore_plugins.core.training.run.RunCapture` (``index=True``) calls :func:`build_rank_parts` from
``close()``, after its writer wrote the last shard and compaction merged the rank's small shards, before the
reports: no part is built while training steps run, so the index costs the steps nothing (the build's time
is reported apart, docs/benchmarks.md). Per listed shard of the rank and capture point it holds, the part
of the index a default query opens (``(capture point, default_dim, seed 0, the store's layers in order)``)
is written by :func:`.index_files.encode_part` from :func:`.index_files.build_piece`, the very functions a
query-time build calls, so its bytes are those a query would write, and listed in the manifest under its
lock (:func:`~metastore_plugins.core.store.vectors.vector_files.add_parts`; ranks closing together never drop each
other's entries). A shard that already has a current part (a resumed run's earlier shards) is skipped.

A part is a cache: one that cannot be built (a full disk, a read-only store) is left to the next query,
its reason kept in one line (:attr:`PartsBuilt.problems`, the first said in a warning); a SIGKILL during
the build leaves at most a temporary file or an unlisted part, which ``verify`` names and the next query
ignores and rebuilds, as after a query-time build killed.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from metastore_plugins.core.analysis.index_files import build_piece, default_dim, encode_part, index_head
from metastore_plugins.core.analysis.sketches import sketch_layers
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import Selection, StoreReader
from metastore_plugins.core.store.shards.entries import shard_pattern
from metastore_plugins.core.store.vectors import vector_files as vf

__all__ = ["PartsBuilt", "build_rank_parts", "build_shard_parts"]


@dataclass
class PartsBuilt:
    """What :func:`build_rank_parts` did: part files written, one line per part left to the next query, and
    the wall seconds it took."""

    written: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _shard_selections(store: StoreReader, shard: str, order: list[str]) -> list[tuple[str, Selection]]:
    """``(capture point, its batches in ``shard``)`` for each capture point the shard holds."""
    points = dict.fromkeys(str(ref.info["capture_point"]) for ref in store.batch_refs() if ref.file.name == shard)
    found = []
    for point in points:
        selection = store.select(point, layers=order)
        rows = [row for row, ref in zip(selection.batch_rows.tolist(), selection.refs) if ref.file.name == shard]
        found.append((point, replace(selection, batch_rows=np.asarray(rows, dtype=np.int64))))
    return found


class _Heads:
    """The default index's ``(key, head)`` per capture point and what its manifest lists, read once each."""

    def __init__(self, store: StoreReader, order: list[str]) -> None:
        self.store, self.order = store, order
        self._heads: dict[str, tuple[str, dict[str, Any]]] = {}
        self._listed: dict[str, dict[str, str]] = {}

    def head(self, point: str) -> tuple[str, dict[str, Any]]:
        if point not in self._heads:
            self._heads[point] = index_head(point, default_dim(self.store, point, self.order), 0, self.order)
        return self._heads[point]

    def current(self, key: str, shard: str, sha: str) -> bool:
        """Whether the manifest of ``key`` lists a part of ``shard`` bound to its sha256 ``sha``."""
        if key not in self._listed:
            try:
                manifest = vf.read_manifest(self.store.path, key)
            except StoreError:
                manifest = None  # damaged: its parts are rewritten
            parts = (manifest or {}).get("parts", [])
            self._listed[key] = {str(p.get("shard")): str(p.get("shard_sha256")) for p in parts}
        return self._listed[key].get(shard) == sha


def build_shard_parts(
    store: StoreReader, shard: str, heads: _Heads | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[str]:
    """Write and list the parts of ``shard`` (a listed shard's file name) of the default index of each capture
    point it holds, unless current; returns the part files written."""
    heads = heads or _Heads(store, sketch_layers(store, None))
    try:
        sha = store.shard_sha256(shard)
    except KeyError:
        raise StoreError(f"{shard} is no longer listed (compacted or removed)") from None
    written = []
    for point, selection in _shard_selections(store, shard, heads.order):
        key, head = heads.head(point)
        if heads.current(key, shard, sha):
            continue
        entry, data = encode_part(build_piece(selection, head, max_bytes), head, key, shard, sha)
        vf.write(store.path, entry["file"], data)
        vf.remove(store.path, vf.add_parts(store.path, key, head, [entry]))
        written.append(entry["file"])
    return written


def build_rank_parts(path: str | os.PathLike[str], rank: int, max_bytes: int = DEFAULT_MAX_BYTES) -> PartsBuilt:
    """Build the missing default-index parts of rank ``rank``'s listed shards; never raises for a part (each
    one that fails is a line in :attr:`PartsBuilt.problems`)."""
    start, built = time.perf_counter(), PartsBuilt()
    try:
        store = StoreReader(path)
        pattern = shard_pattern(rank)
        todo = [name for name in dict.fromkeys(r.file.name for r in store.batch_refs()) if pattern.fullmatch(name)]
        heads = _Heads(store, sketch_layers(store, None))
    except (StoreError, OSError, ValueError) as exc:
        built.problems.append(f"the index parts are left to the next query ({exc})".splitlines()[0])
        todo = []
    for shard in todo:
        try:
            built.written += build_shard_parts(store, shard, heads, max_bytes)
        except Exception as exc:  # a cache: what fails is left to the next query, never to the run's result
            built.problems.append(f"{shard}: its index part is left to the next query ({exc})".splitlines()[0])
    built.seconds = time.perf_counter() - start
    if built.problems:
        more = f" (and {len(built.problems) - 1} more)" if len(built.problems) > 1 else ""
        warnings.warn(f"{built.problems[0]}{more}", stacklevel=2)
    return built
