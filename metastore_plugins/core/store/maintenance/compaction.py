"""Compaction: small shards merged into large ones, every sample kept (repair: :mod:`.repair`).

Compaction holds the rank's lock (:class:`~metastore_plugins.core.store.shards.journal.RankLock`), so it
refuses to run beside a writer of the same rank, and it is crash-safe: new shards are whole on
disk before the journal is replaced atomically, the new journal is read back with the reader
and must list every sample it listed before, and only then are the old shards removed. It
writes only lines the reader accepts: a merge whose line would pass a cap (its bytes, its
capture-point or layer names, the shard numbers a name can hold) is split or not made. Lines
the reader ignores are kept byte for byte. Killed before the journal's rename, it leaves new
unlisted shards; after it, the old ones. Either way the store reads the same, and
:func:`~metastore_plugins.core.store.maintenance.repair.repair` removes the leftovers (they are copies).
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

from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.records import batch_prefix
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.maintenance.repair import JournalLine, repair, scan_journal
from metastore_plugins.core.store.reading.health import one_line
from metastore_plugins.core.store.shards import journal
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import MAX_NAMES, MAX_SHARD_NUMBER, ShardEntry
from metastore_plugins.core.store.shards.index import RankIndex, expectation, join_samples, read_rank
from metastore_plugins.core.store.shards.index_writer import first_free_shard
from metastore_plugins.core.store.shards.journal import RankLock, encode_line, journal_name, rewrite
from metastore_plugins.core.store.shards.shardfile import header_bytes, tensor_layout
from metastore_plugins.core.store.shards.shardinfo import describe
from metastore_plugins.core.store.shards.shardread import DIGESTS, ShardData, read_shard
from metastore_plugins.core.store.writing.writer import StoreWriter

__all__ = ["CompactionReport", "close_and_compact", "compact", "merge_entries", "repair"]

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
    #: each written shard with the ``(file, sha256)`` of the shards it holds, in order (their batches, concatenated)
    groups: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)


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
        raise ConfigError(f"target_bytes must be a positive byte count; got {target_bytes!r}")
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


def _groups(entries: list[ShardEntry], line_bytes: list[int], target_bytes: int) -> list[list[int]]:
    """Runs of consecutive entries of one encoding whose files together stay within ``target_bytes`` and whose
    journal lines within nine tenths of the longest line a reader accepts (the merged line is checked again)."""
    line_cap = journal.MAX_LINE_BYTES * 9 // 10
    groups: list[list[int]] = []
    run: list[int] = []
    size = length = 0
    for i, entry in enumerate(entries):
        fits = (
            run
            and entries[run[0]].encoding == entry.encoding
            and size + entry.bytes <= target_bytes
            and length + line_bytes[i] <= line_cap
        )
        if not fits:
            if len(run) > 1:
                groups.append(run)
            run, size, length = [], 0, 0
        if entry.bytes <= target_bytes // 2 and line_bytes[i] <= line_cap // 2:
            run.append(i)
            size += entry.bytes
            length += line_bytes[i]
        elif run:
            if len(run) > 1:
                groups.append(run)
            run, size, length = [], 0, 0
    if len(run) > 1:
        groups.append(run)
    return groups


def _fitting(members: list[ShardEntry], rank: int) -> list[tuple[list[ShardEntry], ShardEntry | None]]:
    """``members`` split in halves until each part's merged line is one a reader accepts: at most
    ``MAX_LINE_BYTES`` (with room for the real name and size) and ``MAX_NAMES`` capture points and layers.
    A part of one member is not merged (None)."""
    if len(members) == 1:
        return [(members, None)]
    merged = merge_entries(members, mf.shard_name(rank, MAX_SHARD_NUMBER), 0, "0" * 64)
    names_fit = len(merged.capture_points) <= MAX_NAMES and len(merged.layers) <= MAX_NAMES
    if names_fit and len(encode_line(merged.to_json())) + 64 <= journal.MAX_LINE_BYTES:
        return [(members, merged)]
    half = len(members) // 2
    return _fitting(members[:half], rank) + _fitting(members[half:], rank)


def _compact_rank(directory: Path, index: RankIndex, target_bytes: int, report: CompactionReport) -> None:
    rank, layers = index.rank, index.manifest["layers"]
    lines = scan_journal(directory, rank, layers)
    positions = [i for i, line in enumerate(lines) if line.entry is not None]
    entries = [entry for i in positions if (entry := lines[i].entry) is not None]
    report.skipped += index.problems
    report.shards_after += len(entries)
    try:
        if any(line.raw is None for line in lines):
            raise StoreError(f"{journal_name(rank)} holds a line longer than a reader accepts: repair it first")
        if [e.file for e in entries] != [e.file for e in index.entries]:
            raise StoreError(f"{journal_name(rank)} changed while it was read")
        next_number = first_free_shard(directory, rank, [e.file for e in entries])
    except StoreError as exc:
        report.skipped.append(one_line(f"rank {rank}: not compacted: {exc}"))
        return
    replaced: dict[int, ShardEntry] = {}  # first member's position in entries -> merged entry
    groups: list[tuple[str, list[tuple[str, str]]]] = []
    dropped: set[int] = set()
    written: list[str] = []
    with StoreDir(directory) as files:
        for group in _groups(entries, [len(lines[i].raw or b"") for i in positions], target_bytes):
            members = [entries[i] for i in group]
            try:
                datas = {
                    e.file: read_shard(directory / e.file, directory, expectation(e, layers, True)) for e in members
                }
            except StoreError as exc:
                report.skipped.append(one_line(f"{exc}; its run of shards is not compacted"))
                continue
            start = group[0]
            for part, merged in _fitting(members, rank):
                if merged is not None and next_number > MAX_SHARD_NUMBER:
                    report.skipped.append(f"rank {rank}: no shard number left after {MAX_SHARD_NUMBER}; not merged")
                elif merged is not None:
                    merged.file = mf.shard_name(rank, next_number)
                    next_number += 1
                    blob = _merged_shard(part, [datas[e.file] for e in part], merged, layers)
                    files.atomic_write(merged.file, blob)
                    merged.bytes, merged.sha256 = len(blob), hashlib.sha256(blob).hexdigest()
                    merged.xxh3_128 = DIGESTS["xxh3_128"](blob)  # the query path's checksum (issue 35)
                    replaced[start] = merged
                    dropped.update(range(start + 1, start + len(part)))
                    written.append(merged.file)
                    groups.append((merged.file, [(e.file, e.sha256) for e in part]))
                start += len(part)
        if not replaced:
            return
        new_lines = []
        at_of = {position: at for at, position in enumerate(positions)}
        for position, line in enumerate(lines):
            at = at_of.get(position, -1)
            if at in replaced:
                new_lines.append(encode_line(replaced[at].to_json()))
            elif at not in dropped:
                new_lines.append(line.raw or b"")
        if not _rewrite_checked(directory, index, [*replaced.values()], new_lines, lines):
            for name in written:
                files.remove(name, missing_ok=True)
            report.skipped.append(f"rank {rank}: not compacted: the new journal did not read back whole; as it was")
            return
        for i in sorted([*replaced, *dropped]):
            files.remove(entries[i].file, missing_ok=True)
        files.fsync()
    report.merged += [entries[i].file for i in sorted([*replaced, *dropped])]
    report.written += written
    report.groups += groups
    report.shards_after -= len(dropped)


def _rewrite_checked(
    directory: Path, index: RankIndex, merged: list[ShardEntry], new_lines: list[bytes], old: list[JournalLine]
) -> bool:
    """Replace the journal, read it back with the reader: every sample still listed, in order, and no other line
    ignored than before? Else put the old journal back (False)."""
    path = directory / journal_name(index.rank)
    rewrite(path, new_lines)
    after = read_rank(directory, index.rank, directory / mf.manifest_name(index.rank))
    files = {e.file for e in after.entries}
    whole = len(after.problems) == len(index.problems) and all(e.file in files for e in merged)
    if whole:
        before_ids, after_ids = join_samples(index.entries)["sample_id"], join_samples(after.entries)["sample_id"]
        whole = np.array_equal(before_ids, after_ids)  # merging keeps the order of batches and samples
    if not whole:
        rewrite(path, [line.raw or b"" for line in old])
    return whole


def _merged_shard(
    members: list[ShardEntry], datas: list[ShardData], merged: ShardEntry, layers: dict[str, dict[str, object]]
) -> bytes:
    """One safetensors file holding the members' tensors, batches renumbered in order, bytes copied as stored
    (laid out as the writer lays them out: largest element size first), describing itself as the writer's do."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    sources: dict[str, memoryview] = {}
    offset = 0
    for entry, data in zip(members, datas):
        for key in data.keys():
            batch, rest = key.split("/", 1)
            new = batch_prefix(int(batch[1:]) + offset) + rest
            dtype, shape, raw = data.stored(key)
            specs[new], sources[new] = (dtype, shape), raw
        offset += len(entry.batches["step"])
    ranges, size = tensor_layout(specs)
    section = bytearray(size)
    for key, (begin, end) in ranges.items():
        section[begin:end] = sources[key]
    metadata = {"format": mf.FORMAT, "encoding": members[0].encoding}
    metadata.update(describe(merged, layers, [(key, len(shape)) for key, (_, shape) in specs.items()]))
    return header_bytes(ranges, specs, metadata) + bytes(section)


def close_and_compact(
    writer: StoreWriter, error: BaseException | None = None, how: str | None = None
) -> CompactionReport | None:
    """Close ``writer`` (``error``, ``how``: how the run ended, for its run log: :meth:`StoreWriter.close`), then
    compact its rank (the end of training: the timer's small shards merged).

    A compaction that fails (another process holds the rank, a full disk) warns and leaves the
    store as the writer left it; None then, and when the writer stopped after a disk error.
    """
    if writer.closed:
        return None
    writer.close(error, how=how)
    if writer.stopped is not None:
        return None
    try:
        return compact(writer.path, writer.shard_bytes, ranks=[writer.rank])
    except (StoreError, OSError) as exc:
        warnings.warn(f"the store {writer.path} was not compacted ({exc}); it is complete as it is", stacklevel=2)
        return None


#: The dtypes the writer gives these columns
#: (:func:`~metastore_plugins.core.store.shards.entries.new_entry`), so that a merged line stays short.
_NARROW = {"capture_point": np.int32, "meta": np.uint8, "batch": np.int32, "layer": np.int32, "kind": np.uint8}


def merge_entries(members: list[ShardEntry], file: str, nbytes: int, sha256: str) -> ShardEntry:
    """One entry for the members' batches in order, under a new file."""
    point_of = {name: i for i, name in enumerate(dict.fromkeys(p for e in members for p in e.capture_points))}
    layer_of = {name: i for i, name in enumerate(dict.fromkeys(name for e in members for name in e.layers))}
    points, layer_names = list(point_of), list(layer_of)
    batches: dict[str, list[np.ndarray]] = {}
    records: dict[str, list[np.ndarray]] = {}
    offset = 0
    for e in members:
        point_map = np.array([point_of[p] for p in e.capture_points], dtype=np.int32)
        layer_map = np.array([layer_of[n] for n in e.layers], dtype=np.int32)
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
        {
            k: np.concatenate(v).astype(_NARROW.get(k, np.int64) if k != "lr" else np.float64)
            for k, v in batches.items()
        },
        {k: np.concatenate(v).astype(_NARROW.get(k, np.int64)) for k, v in records.items()},
        samples,
    )
