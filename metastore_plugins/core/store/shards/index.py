"""The store's index in memory: every rank's shards, batches, records and sample rows as numpy columns.

:func:`read_rank` reads one rank's manifest and journal (or a version 1 manifest) without
following links or blocking on special files; :class:`StoreIndex` joins the ranks' entries
into global columns, so that listing, selecting and per-sample metadata are array operations
(a million rows open in well under a second) and no shard is opened before its records are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.errors import JournalError, StoreError
from metastore_plugins.core.records import FLOAT_SAMPLE_COLUMNS, KIND_CODES, SAMPLE_COLUMNS
from metastore_plugins.core.store.files import open_regular, read_bounded
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import (
    BATCH_FIELDS,
    RECORD_FIELDS,
    ShardEntry,
    entry_from_json,
    entry_from_v1,
    meta_columns,
)
from metastore_plugins.core.store.shards.journal import decode_line, journal_name, read_lines
from metastore_plugins.core.store.shards.shardread import ShardExpectation, expected_keys


@dataclass
class RankIndex:
    """What one rank's files say: its manifest, its trusted shard entries, and what was ignored."""

    rank: int
    manifest: dict[str, Any]
    entries: list[ShardEntry]
    problems: list[str] = field(default_factory=list)  # lines ignored, one readable line each
    good_size: int = 0  # bytes of the journal up to its last complete line (a writer appends there)

    @property
    def version(self) -> int:
        return int(self.manifest["schema_version"])


def read_rank(directory: Path, rank: int, path: Path) -> RankIndex:
    """Read rank ``rank``'s manifest ``path`` and journal; :class:`StoreError` when the manifest is unusable.

    Journal lines that cannot be trusted (torn, damaged, malformed, a shard listed twice) are
    skipped and listed in ``problems``; the entries around them stay readable.
    """
    try:
        manifest = mf.parse_manifest(read_bounded(path, directory, mf.MAX_MANIFEST_BYTES, "manifest"), path, rank)
    except ValueError as exc:
        raise StoreError(str(exc)) from exc
    if manifest["schema_version"] == 1:
        return RankIndex(rank, manifest, [entry_from_v1(shard, rank) for shard in manifest["shards"]])
    index = RankIndex(rank, manifest, [])
    journal = directory / journal_name(rank)
    if not os.path.lexists(journal):
        return index
    fd, _ = open_regular(journal, directory)
    seen: set[str] = set()
    with os.fdopen(fd, "rb") as handle:
        for number, line, offset in read_lines(handle):
            if line is not None and line.endswith(b"\n"):
                index.good_size = offset
            try:
                if line is None:
                    raise JournalError(f"longer than the {2**28} bytes a reader accepts")
                entry = entry_from_json(decode_line(line), rank, manifest["layers"])
                if entry.file in seen:
                    raise JournalError(f"lists {entry.file} again")
            except JournalError as exc:
                index.problems.append(f"{journal.name} line {number}: {exc}; ignored")
                continue
            seen.add(entry.file)
            index.entries.append(entry)
    return index


_BATCH_COLUMNS = ("shard", "j", "capture_point", "rank", "row0", "rec0", "nrec", *BATCH_FIELDS[1:])


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    offsets = np.repeat(starts - (ends - counts), counts)  # (total,)
    return np.arange(total, dtype=np.int64) + offsets


class StoreIndex:
    """Every rank's entries as global columns, batches in selection order.

    ``batch[c]`` has one row per stored batch, sorted by (step, micro-batch, rank, position
    in its rank's journal); ``batch["row0"]`` is where its samples start in ``sample[c]``
    (rows in journal order) and ``batch["rec0"]``/``"nrec"`` its records in ``record[c]``.
    """

    def __init__(self, entries: list[ShardEntry], layers: dict[str, dict[str, Any]]) -> None:
        self.shards = entries
        self.layers = layers
        self.capture_point_names = sorted({name for e in entries for name in e.capture_points})
        self.layer_names = list(layers)
        points = {name: i for i, name in enumerate(self.capture_point_names)}
        layer_ids = {name: i for i, name in enumerate(self.layer_names)}
        parts: dict[str, list[np.ndarray]] = {}
        records: dict[str, list[np.ndarray]] = {}
        row0 = rec0 = 0
        for s, entry in enumerate(entries):
            b, r = entry.batches, entry.records
            n_b = len(b["step"])
            local_points = np.array([points[name] for name in entry.capture_points], dtype=np.int64)
            sizes = b["size"]
            columns = {
                "shard": np.full(n_b, s, dtype=np.int64),
                "j": np.arange(n_b, dtype=np.int64),
                "capture_point": local_points[b["capture_point"]] if n_b else np.zeros(0, np.int64),
                "rank": np.full(n_b, entry.rank, dtype=np.int64),
                "row0": row0 + np.cumsum(sizes) - sizes,
                "rec0": rec0 + np.searchsorted(r["batch"], np.arange(n_b)),
                "nrec": np.bincount(r["batch"], minlength=n_b).astype(np.int64),
                **{key: b[key] for key in ("step", "epoch", "micro_batch", "size", "lr", "meta")},
            }
            for key, value in columns.items():
                parts.setdefault(key, []).append(value)
            local_layers = np.array([layer_ids[name] for name in entry.layers], dtype=np.int64)
            for key, value in r.items():
                records.setdefault(key, []).append(local_layers[value] if key == "layer" and len(value) else value)
            row0 += int(sizes.sum())
            rec0 += len(r["batch"])
        if not entries:  # a rank with no shard yet, or every journal line ignored: empty columns
            parts = {key: [np.zeros(0, np.float64 if key == "lr" else np.int64)] for key in _BATCH_COLUMNS}
            records = {key: [np.zeros(0, np.int64)] for key in RECORD_FIELDS}
        joined = {key: np.concatenate(value) for key, value in parts.items()}
        order = np.lexsort((np.arange(len(joined["step"])), joined["rank"], joined["micro_batch"], joined["step"]))
        self.batch = {key: value[order] for key, value in joined.items()}
        self.record = {key: np.concatenate(value) for key, value in records.items()}
        self.sample = join_samples(entries)

    def __len__(self) -> int:
        """The number of stored batches."""
        return len(self.batch.get("step", ()))

    def rows(self, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(sample rows, the position in batches of each row's batch)`` of the given batch rows, in order."""
        sizes = self.batch["size"][batches]
        return _ranges(self.batch["row0"][batches], sizes), np.repeat(np.arange(len(batches)), sizes)

    def expectation(self, shard: int, checksums: bool, fast: bool = False) -> ShardExpectation:
        """The size, checksums and exact tensor keys the index expects of shard ``shard`` (see :func:`expectation`)."""
        return expectation(self.shards[shard], self.layers, checksums, fast)


def expectation(
    entry: ShardEntry, layers: dict[str, dict[str, Any]], checksums: bool, fast: bool = False
) -> ShardExpectation:
    """The size, checksums and exact tensor keys an entry says its shard holds.

    ``checksums``: every checksum the entry lists (``sha256``, and ``xxh3_128`` where its line has
    one: ``verify``, repair, compaction); with ``fast`` too, ``xxh3_128`` alone where listed, else
    ``sha256`` (the query path). Without ``checksums``: none (the size and keys are still checked).
    """
    described = []
    roles = [list(layers[name]["params"]) for name in entry.layers]
    kinds, layer_of = entry.records["kind"].tolist(), entry.records["layer"].tolist()
    metas = entry.batches["meta"].tolist()
    columns = {mask: meta_columns(mask) for mask in set(metas)}
    # records are grouped by batch in order (checked): batch j's are one slice, found in O(n_b + n_r)
    bounds = np.searchsorted(entry.records["batch"], np.arange(len(metas) + 1)).tolist()
    for j, meta in enumerate(metas):
        records = [(KIND_CODES[kinds[k]], roles[layer_of[k]]) for k in range(bounds[j], bounds[j + 1])]
        described.append((columns[meta], records))
    required, optional = expected_keys(described, entry.encoding)
    xxh3 = entry.xxh3_128 if checksums else None
    sha256 = entry.sha256 if checksums and not (fast and xxh3) else None
    return ShardExpectation(entry.bytes, sha256, required, optional, xxh3)


def join_samples(entries: list[ShardEntry]) -> dict[str, np.ndarray]:
    """The entries' sample columns joined; a column some entries lack is filled (-1, or NaN for floats)."""
    names = [key for key in SAMPLE_COLUMNS if any(key in (e.samples or {}) for e in entries)]
    joined: dict[str, np.ndarray] = {}
    for key in names or ["sample_id"]:
        parts = [(e.samples or {}).get(key) for e in entries]
        floating = key in FLOAT_SAMPLE_COLUMNS or any(p is not None and p.dtype.kind == "f" for p in parts)
        fill = np.nan if floating else -1
        dtype = np.float32 if key in FLOAT_SAMPLE_COLUMNS else (np.float64 if floating else np.int64)
        joined[key] = (
            np.concatenate(
                [np.full(e.rows, fill, dtype) if p is None else p.astype(dtype) for e, p in zip(entries, parts)]
            )
            if entries
            else np.zeros(0, dtype)
        )
    return joined
