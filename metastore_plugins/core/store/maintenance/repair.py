"""Repair: what a stopped writer or compaction left behind cleaned up, without losing a readable sample.

Per rank, under its lock (:class:`~metastore_plugins.core.store.shards.journal.RankLock`):

- temporary files of the rank's names are removed (never a complete file);
- journal lines that cannot be read at all (torn, CRC-damaged, not JSON, a shard listed twice)
  are dropped, and so are entries whose shard file is gone; a line that is whole (its CRC holds)
  but that this version cannot use (an unknown column from a newer version, a layer the manifest
  lacks) is kept byte for byte, with its shard;
- every shard file no kept line lists is, in this order: removed when listed shards hold each of
  its batches byte for byte as the same batch (tensors, sample ids, capture point, step: a
  compaction's leftover; a shard that does not describe its batches is never taken for a copy);
  re-listed when it describes itself (:mod:`~metastore_plugins.core.store.shards.shardinfo`: the layers
  it names are added to the manifest); otherwise set aside in ``quarantine/`` and reported. A
  shard that may hold the only copy of a sample is never deleted;
- a missing manifest is rebuilt from the layers the rank's shards describe; when one of them does
  not, the rank is left untouched and the message says how to restore it;
- then the nearest-gradient index (``vector_index/``, a cache): its damaged or stale files and a
  stopped build's leftovers are removed (:func:`~metastore_plugins.core.store.vectors.vector_check.repair`);
  the next query rebuilds them.

The manifest is written before the journal, the journal is read back with the reader and
checked before anything is removed, and every removal names what it removed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metastore_plugins.core.errors import JournalError, StoreError
from metastore_plugins.core.store.file_kinds import any_temporary_target
from metastore_plugins.core.store.files import StoreDir, open_regular
from metastore_plugins.core.store.maintenance.shard_copies import ShardCopies
from metastore_plugins.core.store.reading.health import QUARANTINE, leftover_rank
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import ShardEntry, entry_from_json, shard_pattern
from metastore_plugins.core.store.shards.index import StoreIndex, read_rank
from metastore_plugins.core.store.shards.journal import (
    MAX_LINE_BYTES,
    RankLock,
    decode_line,
    encode_line,
    journal_name,
    read_lines,
    rewrite,
)
from metastore_plugins.core.store.shards.shardinfo import batch_prints, entry_from_shard, read_unlisted
from metastore_plugins.core.store.tags import tag_cache
from metastore_plugins.core.store.vectors import vector_check


@dataclass
class JournalLine:
    """One line of a rank's journal as repair and compaction see it."""

    number: int  # from 1
    raw: bytes | None  # None: longer than a reader accepts (not kept in memory)
    file: str | None  # the shard its JSON names, when the line is whole (CRC valid) and names one of the rank's
    entry: ShardEntry | None  # the trusted entry, when the reader accepts the line
    problem: str | None  # why the reader ignores it


def scan_journal(directory: Path, rank: int, layers: dict[str, Any]) -> list[JournalLine]:
    """Every line of rank ``rank``'s journal, classified as
    :func:`~metastore_plugins.core.store.shards.index.read_rank` reads it."""
    path = directory / journal_name(rank)
    if not os.path.lexists(path):
        return []
    lines: list[JournalLine] = []
    seen: set[str] = set()
    fd, _ = open_regular(path, directory)
    with os.fdopen(fd, "rb") as handle:
        for number, line, _ in read_lines(handle):
            if line is None:
                lines.append(
                    JournalLine(number, None, None, None, f"longer than the {MAX_LINE_BYTES} bytes a reader accepts")
                )
                continue
            file = None
            try:
                raw = decode_line(line)
                named = raw.get("file")
                file = named if isinstance(named, str) and shard_pattern(rank).fullmatch(named) else None
                if file in seen:
                    file = None
                    raise JournalError(f"lists {named} again")
                entry = entry_from_json(raw, rank, layers)
            except JournalError as exc:
                lines.append(JournalLine(number, line, file, None, str(exc)))
            else:
                lines.append(JournalLine(number, line, entry.file, entry, None))
            if file is not None:
                seen.add(file)
    return lines


def repair(directory: str | os.PathLike[str]) -> list[str]:
    """Repair every rank of the store (module docstring); one line per thing changed or refused."""
    directory = Path(directory)
    if not directory.is_dir():
        raise StoreError(f"{directory} is not a metastore store: it does not exist")
    manifests = dict(mf.find_manifests(directory))
    ranks = set(manifests) | {r for name in os.listdir(directory) if (r := leftover_rank(name)) is not None}
    done: list[str] = []
    for rank in sorted(ranks):
        with RankLock(directory, rank), StoreDir(directory) as files:
            done += _repair_rank(directory, files, rank, manifests.get(rank))
    return done + vector_check.repair(directory, *_listed(directory)) + tag_cache.repair(directory)


def _listed(directory: Path) -> tuple[dict[str, str], StoreIndex | None]:
    """Listed shard -> its sha256, and the store's index, as the repaired journals list them (a rank that cannot
    be read lists none): the index files are checked against them."""
    entries: list[ShardEntry] = []
    layers: dict[str, dict[str, Any]] = {}
    for rank, path in mf.find_manifests(directory):
        try:
            read = read_rank(directory, rank, path)
        except StoreError:
            continue
        entries += read.entries
        layers |= read.manifest["layers"]
    try:
        index: StoreIndex | None = StoreIndex(entries, layers)
    except (KeyError, ValueError):  # ranks that disagree on their layers: the parts' rows are not checked
        index = None
    return {entry.file: entry.sha256 for entry in entries}, index


def _repair_rank(directory: Path, files: StoreDir, rank: int, manifest_path: Path | None) -> list[str]:
    pattern = shard_pattern(rank)
    shards = sorted(name for name in files.listdir() if pattern.fullmatch(name) and files.kind(name) == "file")
    done: list[str] = []
    if manifest_path is None and shards:
        refused = _rebuild_manifest(directory, rank, shards)
        if refused is not None:
            return [refused]
        manifest_path = directory / mf.manifest_name(rank)
        done.append(f"{mf.manifest_name(rank)}: rebuilt from the layers its shards describe (its config is lost)")
    done += _remove_temporaries(files, rank)
    copies: list[str] = []
    if manifest_path is None:
        done += _sort_unlisted(directory, files, rank, {}, [], [], [], copies, v1=True)
        return done + _remove(files, copies)
    index = read_rank(directory, rank, manifest_path)
    if index.version < mf.JOURNAL_VERSION:
        listed = [entry.file for entry in index.entries]
        layers = index.manifest["layers"]
        done += _sort_unlisted(directory, files, rank, layers, listed, index.entries, [], copies, v1=True)
        return done + _remove(files, copies)
    layers = dict(index.manifest["layers"])
    lines = scan_journal(directory, rank, layers)
    kept: list[JournalLine] = []
    for line in lines:
        name = line.entry.file if line.entry is not None else line.file
        if name is not None and not files.exists(name):
            done.append(f"{journal_name(rank)}: removed the entry of {name} (the file is gone)")
        elif name is None:
            done.append(f"removed: {journal_name(rank)} line {line.number}: {line.problem}; ignored")
        else:
            kept.append(line if line.entry is not None else _with_layers(directory, rank, line, layers, done))
    trusted = [line.entry for line in kept if line.entry is not None]
    new_entries: list[ShardEntry] = []
    claimed = [line.file or "" for line in kept]
    done += _sort_unlisted(directory, files, rank, layers, claimed, trusted, new_entries, copies, v1=False)
    if layers != index.manifest["layers"] or len(kept) != len(lines) or new_entries:
        manifest = {**index.manifest, "layers": layers}
        _write_index(directory, rank, manifest, layers != index.manifest["layers"], kept, lines, new_entries)
    return done + _remove(files, copies)


def _remove(files: StoreDir, names: list[str]) -> list[str]:
    """Remove the copies found (each line that says so was already written); nothing more to say."""
    for name in names:
        files.remove(name, missing_ok=True)
    files.fsync()
    return []


def _with_layers(directory: Path, rank: int, line: JournalLine, layers: dict[str, Any], done: list[str]) -> JournalLine:
    """A whole line the reader ignores, kept byte for byte; trusted once the layers its shard describes are added
    to ``layers`` (a manifest that lost a layer), else reported."""
    assert line.file is not None and line.raw is not None
    try:
        _, specs = entry_from_shard(directory, line.file, rank)
        if all(layers.get(name, spec) == spec for name, spec in specs.items()):
            entry = entry_from_json(decode_line(line.raw), rank, {**layers, **specs})
            added = sorted(set(specs) - set(layers))
            layers.update(specs)
            if added:
                done.append(
                    f"{mf.manifest_name(rank)}: layer(s) {', '.join(map(repr, added))} added from {line.file}'s own "
                    f"description ({journal_name(rank)} line {line.number} names them)"
                )
            return JournalLine(line.number, line.raw, line.file, entry, None)
    except (StoreError, JournalError):
        pass
    done.append(
        f"{journal_name(rank)} line {line.number}: NOT repaired, kept as it is with its shard {line.file} "
        f"({line.problem}): read it with the newer metastore_plugins that wrote it, or restore the manifest"
    )
    return line


def _remove_temporaries(files: StoreDir, rank: int) -> list[str]:
    done = []
    ours = (mf.manifest_name(rank), journal_name(rank))
    for name in sorted(files.listdir()):
        target = any_temporary_target(name)
        if target is None or not (target in ours or shard_pattern(rank).fullmatch(target)):
            continue
        if files.kind(name) == "directory":
            done.append(f"{name}: a directory where a temporary file would be; NOT removed, remove it yourself")
            continue
        files.remove(name, missing_ok=True)
        done.append(f"{name}: removed (a temporary file)")
    return done


def _rebuild_manifest(directory: Path, rank: int, shards: list[str]) -> str | None:
    """Write rank ``rank``'s manifest from its shards' descriptions; the refusal message when they do not suffice."""
    layers: dict[str, Any] = {}
    for name in shards:
        try:
            _, specs = entry_from_shard(directory, name, rank)
            conflict = [layer for layer, spec in specs.items() if layers.get(layer, spec) != spec]
            if conflict:
                raise StoreError(f"{name}: describes layer {conflict[0]!r} unlike another shard")
        except StoreError as exc:
            return (
                f"rank {rank}: NOT repaired: {mf.manifest_name(rank)} is missing and cannot be rebuilt "
                f"({str(exc)[:300]}); restore {mf.manifest_name(rank)} (from a backup or another copy of the store) "
                f"and run repair again; nothing of rank {rank} was changed"
            )
        layers.update(specs)
    manifest = mf.new_manifest(rank, {})
    manifest["layers"] = layers
    mf.write_manifest(directory, manifest)
    return None


def _sort_unlisted(
    directory: Path,
    files: StoreDir,
    rank: int,
    layers: dict[str, Any],
    claimed: list[str],
    trusted: list[ShardEntry],
    new_entries: list[ShardEntry],
    copies_found: list[str],
    v1: bool,
) -> list[str]:
    """Remove, re-list (into ``new_entries``, ``layers`` completed) or set aside each shard of ``rank`` no line
    claims; links and special files under a shard's name are removed (never what they point to)."""
    done: list[str] = []
    copies = ShardCopies(directory, layers, trusted)
    pattern = shard_pattern(rank)
    for name in sorted(n for n in files.listdir() if pattern.fullmatch(n) and n not in claimed):
        kind, undescribed = files.kind(name), ""
        if kind == "directory":
            done.append(f"{name}: a directory where a shard would be; NOT removed, remove it yourself")
            continue
        if kind != "file":
            files.remove(name, missing_ok=True)
            done.append(f"{name}: removed (a {kind}, not a shard; a link's target is left alone)")
            continue
        try:
            read = read_unlisted(directory, name)
        except StoreError as exc:
            done.append(_set_aside(files, name, f"it cannot be read: {_short(exc, directory / name)}"))
            continue
        data = read[0]
        try:
            entry, specs = entry_from_shard(directory, name, rank, read)
        except StoreError as exc:  # it cannot say what its batches are: never taken for a copy, never listed
            undescribed = _short(exc, directory / name)
        prints = batch_prints(data)
        held = None if undescribed else copies.held(data, prints, entry)
        if held is not None and all(held):
            copies_found.append(name)  # removed by the caller once the journal is written and read back
            done.append(f"{name}: removed (a copy: listed shards hold each of its batches byte for byte)")
            continue
        if held is not None and any(held):
            done.append(_set_aside(files, name, "listed shards hold some of its batches but not all"))
            continue
        if v1:
            done.append(_set_aside(files, name, "this rank has no manifest, or a version 1 one: it cannot be listed"))
            continue
        if undescribed:
            done.append(_set_aside(files, name, undescribed))
            continue
        conflict = [layer for layer, spec in specs.items() if layers.get(layer, spec) != spec]
        if conflict:
            done.append(_set_aside(files, name, f"its layer {conflict[0]!r} differs from the manifest's"))
            continue
        layers.update(specs)
        new_entries.append(entry)
        copies.add(entry, prints)
        done.append(f"{name}: listed again (its journal line rebuilt from the shard's own description)")
    return done


def _short(exc: StoreError, path: Path) -> str:
    text = str(exc)
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def _set_aside(files: StoreDir, name: str, why: str) -> str:
    """Move shard ``name`` into ``quarantine/`` (never over an entry there); the line that says so."""
    with files.subdir(QUARANTINE, create=True) as aside:
        target = files.move_into(name, aside)
    return (
        f"{name}: set aside as {QUARANTINE}/{target} ({why}); NOT deleted: move it back once the store can list it, "
        "or delete it yourself"
    )


def _write_index(
    directory: Path,
    rank: int,
    manifest: dict[str, Any],
    layers_added: bool,
    kept: list[JournalLine],
    lines: list[JournalLine],
    new_entries: list[ShardEntry],
) -> None:
    """Manifest (when layers were added), then the journal, read back and checked with the reader."""
    if layers_added:
        mf.write_manifest(directory, manifest)
    journal = directory / journal_name(rank)
    rewrite(journal, [line.raw or b"" for line in kept] + [encode_line(e.to_json()) for e in new_entries])
    after = read_rank(directory, rank, directory / mf.manifest_name(rank))
    expected = [line.entry.file for line in kept if line.entry is not None] + [e.file for e in new_entries]
    if not set(expected) <= {entry.file for entry in after.entries}:
        rewrite(journal, [line.raw or b"" for line in lines])
        raise StoreError(
            f"{journal}: the repaired journal did not read back whole ({after.problems[:2]}); the old one is back, "
            "nothing was removed or set aside: report this as a bug"
        )
