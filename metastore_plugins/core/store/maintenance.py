"""Compaction (small shards merged into large ones) and repair (leftovers of a stopped writer removed).

Both hold the rank's lock (:class:`~metastore_plugins.core.store.journal.RankLock`), so they
refuse to run beside a writer of the same rank, and both are crash-safe: new files are whole
on disk before the journal is replaced atomically, and files are removed only once nothing
lists them. A compaction killed before the journal's rename leaves new unlisted shards; after
it, the old ones. Either way the store reads the same, and :func:`repair` removes the leftovers.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from metastore_plugins.core.store import manifest as mf
from metastore_plugins.core.store.entries import ShardEntry, shard_pattern
from metastore_plugins.core.store.health import TEMPORARY, leftover_rank, one_line
from metastore_plugins.core.store.index import RankIndex, expectation, join_samples, read_rank
from metastore_plugins.core.store.index_writer import first_free_shard
from metastore_plugins.core.store.journal import RankLock, encode_line, journal_name, rewrite
from metastore_plugins.core.store.manifest import StoreError
from metastore_plugins.core.store.shardfile import header_bytes, tensor_layout
from metastore_plugins.core.store.shardread import ShardData, read_shard
from metastore_plugins.core.store.writer import StoreWriter

#: Shards are merged up to this size (the writer's default ``shard_bytes``).
TARGET_BYTES = 64 * 2**20


@dataclass
class CompactionReport:
    """What :func:`compact` did, per store."""

    shards_before: int = 0
    shards_after: int = 0
    merged: list[str] = field(default_factory=list)  # the small shards that were merged and removed
    written: list[str] = field(default_factory=list)  # the shards that replace them
    skipped: list[str] = field(default_factory=list)  # why a rank or shard was left as it was


def _ranks(directory: Path) -> list[tuple[int, Path]]:
    return mf.find_manifests(directory)


def compact(
    directory: str | os.PathLike[str], target_bytes: int = TARGET_BYTES, ranks: Sequence[int] | None = None
) -> CompactionReport:
    """Merge runs of consecutive small shards (same encoding) of every rank (or of ``ranks``) into shards of
    about ``target_bytes``.

    Batches keep their order and content byte for byte; only shard files and journal lines change.
    A version 1 rank, and a shard that does not read back sound, are left as they are (``skipped``).
    """
    directory = Path(directory)
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be a positive byte count; got {target_bytes!r}")
    report = CompactionReport()
    found = _ranks(directory)
    if not found:
        raise StoreError(f"{directory} is not a metastore store: it holds no manifest-rank*.json")
    for rank, path in found:
        if ranks is not None and rank not in ranks:
            continue
        with RankLock(directory, rank):
            index = read_rank(directory, rank, path)
            report.shards_before += len(index.entries)
            if index.version < mf.JOURNAL_VERSION:
                report.skipped.append(f"rank {rank}: format version {index.version} stores are not compacted")
                report.shards_after += len(index.entries)
                continue
            _compact_rank(directory, index, target_bytes, report)
    return report


def _groups(entries: list[ShardEntry], target_bytes: int) -> list[list[int]]:
    """Runs of consecutive entries of one encoding whose files together stay within ``target_bytes``."""
    groups: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i, entry in enumerate(entries):
        fits = run and entries[run[0]].encoding == entry.encoding and size + entry.bytes <= target_bytes
        if not fits:
            if len(run) > 1:
                groups.append(run)
            run, size = [], 0
        if entry.bytes <= target_bytes // 2:
            run.append(i)
            size += entry.bytes
        elif run:
            if len(run) > 1:
                groups.append(run)
            run, size = [], 0
    if len(run) > 1:
        groups.append(run)
    return groups


def _compact_rank(directory: Path, index: RankIndex, target_bytes: int, report: CompactionReport) -> None:
    layers = index.manifest["layers"]
    replaced: dict[int, ShardEntry] = {}  # first member -> merged entry
    dropped: set[int] = set()
    next_number = first_free_shard(directory, index.rank, [e.file for e in index.entries])
    for group in _groups(index.entries, target_bytes):
        members = [index.entries[i] for i in group]
        try:
            datas = [read_shard(directory / e.file, directory, expectation(e, layers, True)) for e in members]
        except StoreError as exc:
            report.skipped.append(one_line(f"{exc}; its run of shards is not compacted"))
            continue
        name = mf.shard_name(index.rank, next_number)
        next_number += 1
        blob = _merged_shard(members, datas)
        mf.atomic_write_bytes(directory / name, blob)
        merged = merge_entries(members, name, len(blob), hashlib.sha256(blob).hexdigest())
        replaced[group[0]] = merged
        dropped.update(group[1:])
        report.merged += [e.file for e in members]
        report.written.append(name)
    report.skipped += index.problems
    kept = [replaced.get(i, e) for i, e in enumerate(index.entries) if i not in dropped]
    report.shards_after += len(kept)
    if replaced or index.problems:
        rewrite(directory / journal_name(index.rank), [encode_line(e.to_json()) for e in kept])
    for i in sorted([*replaced, *dropped]):
        (directory / index.entries[i].file).unlink(missing_ok=True)
    mf.fsync_dir(directory)


def _merged_shard(members: list[ShardEntry], datas: list[ShardData]) -> bytes:
    """One safetensors file holding the members' tensors, batches renumbered in order, bytes copied as stored
    (laid out as the writer lays them out: largest element size first)."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    sources: dict[str, memoryview] = {}
    offset = 0
    for entry, data in zip(members, datas):
        for key in data.keys():
            batch, rest = key.split("/", 1)
            new = f"b{int(batch[1:]) + offset}/{rest}"
            dtype, shape, raw = data.stored(key)
            specs[new], sources[new] = (dtype, shape), raw
        offset += len(entry.batches["step"])
    ranges, size = tensor_layout(specs)
    section = bytearray(size)
    for key, (begin, end) in ranges.items():
        section[begin:end] = sources[key]
    return header_bytes(ranges, specs, {"format": mf.FORMAT, "encoding": members[0].encoding}) + bytes(section)


def close_and_compact(writer: StoreWriter) -> CompactionReport | None:
    """Close ``writer``, then compact its rank (the end of training: the timer's small shards merged).

    A compaction that fails (another process holds the rank, a full disk) warns and leaves the
    store as the writer left it; None then, and when the writer stopped after a disk error.
    """
    if writer.closed:
        return None
    writer.close()
    if writer.stopped is not None:
        return None
    try:
        return compact(writer.path, writer.shard_bytes, ranks=[writer.rank])
    except (StoreError, OSError) as exc:
        warnings.warn(f"the store {writer.path} was not compacted ({exc}); it is complete as it is", stacklevel=2)
        return None


def merge_entries(members: list[ShardEntry], file: str, nbytes: int, sha256: str) -> ShardEntry:
    """One entry for the members' batches in order, under a new file."""
    points = list(dict.fromkeys(p for e in members for p in e.capture_points))
    layer_names = list(dict.fromkeys(name for e in members for name in e.layers))
    batches: dict[str, list[np.ndarray]] = {}
    records: dict[str, list[np.ndarray]] = {}
    offset = 0
    for e in members:
        point_map = np.array([points.index(p) for p in e.capture_points], dtype=np.int64)
        layer_map = np.array([layer_names.index(n) for n in e.layers], dtype=np.int64)
        for key, value in e.batches.items():
            batches.setdefault(key, []).append(point_map[value] if key == "capture_point" else value)
        for key, value in e.records.items():
            if key == "batch":
                value = value + offset
            elif key == "layer" and len(value):
                value = layer_map[value]
            records.setdefault(key, []).append(value)
        offset += len(e.batches["step"])
    samples = join_samples(members)
    return ShardEntry(
        file,
        nbytes,
        sha256,
        members[0].encoding,
        members[0].rank,
        points,
        layer_names,
        {k: np.concatenate(v) for k, v in batches.items()},
        {k: np.concatenate(v) for k, v in records.items()},
        samples,
    )


def repair(directory: str | os.PathLike[str]) -> list[str]:
    """Remove what a stopped writer or compaction left: unlisted shards, temporary files, journal lines that
    cannot be trusted or whose shard is gone. Returns one line per thing removed; a listed shard is never touched.
    """
    directory = Path(directory)
    removed: list[str] = []
    manifests = dict(_ranks(directory))
    if not directory.is_dir():
        raise StoreError(f"{directory} is not a metastore store: it does not exist")
    names = sorted(os.listdir(directory))
    ranks = set(manifests) | {r for n in names if (r := leftover_rank(n)) is not None}
    for rank in sorted(ranks):
        with RankLock(directory, rank):
            index = read_rank(directory, rank, manifests[rank]) if rank in manifests else None
            listed = {e.file for e in index.entries} if index is not None else set()
            removed += _remove_leftovers(directory, rank, listed)
            if index is not None and index.version >= 2:
                removed += _repair_journal(directory, index)
    return removed


def _remove_leftovers(directory: Path, rank: int, listed: set[str]) -> list[str]:
    removed = []
    pattern = shard_pattern(rank)
    for name in sorted(os.listdir(directory)):
        stem = name.removesuffix(".tmp")
        ours = pattern.fullmatch(stem) or stem in (mf.manifest_name(rank), journal_name(rank))
        if not ours or name in listed:
            continue
        temporary = TEMPORARY.fullmatch(name) is not None
        if not temporary and not pattern.fullmatch(name):
            continue
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            removed.append(f"{name}: a directory where a shard would be; NOT removed, remove it yourself")
            continue
        path.unlink(missing_ok=True)
        removed.append(f"{name}: removed ({'a temporary file' if temporary else 'a shard the index does not list'})")
    return removed


def _repair_journal(directory: Path, index: RankIndex) -> list[str]:
    gone = [e for e in index.entries if not os.path.lexists(directory / e.file)]
    if not gone and not index.problems:
        return []
    kept = [e for e in index.entries if e not in gone]
    rewrite(directory / journal_name(index.rank), [encode_line(e.to_json()) for e in kept])
    lines = [f"{journal_name(index.rank)}: removed the entry of {e.file} (the file is gone)" for e in gone]
    return lines + [f"removed: {problem}" for problem in index.problems]
