"""Checking a store's files against its index (``verify``), and reading version 1 stores' sample rows."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import META_BITS, meta_key, meta_prefix
from metastore_plugins.core.store.file_kinds import TEMPORARY_SUFFIX, kind_of
from metastore_plugins.core.store.reading.batches import ShardFiles
from metastore_plugins.core.store.shards.entries import ShardEntry, sample_columns
from metastore_plugins.core.store.shards.index import StoreIndex, expectation
from metastore_plugins.core.store.shards.journal import unpack
from metastore_plugins.core.store.shards.shardinfo import INFO_KEY
from metastore_plugins.core.store.shards.shardread import ShardData, read_shard
from metastore_plugins.core.store.vectors import vector_check

#: Files a writer or compaction leaves behind when it stops: shards and temporary files.
SHARD_LIKE = re.compile(r"rank(0|[1-9][0-9]{0,8})-[0-9]{6,9}\.safetensors", re.ASCII)
#: A writer's, compaction's or repair's temporary files (the name of what it replaces + :data:`TEMPORARY_SUFFIX`,
#: or + ``.tmp`` in stores written before): only these are reported and removed by repair, never another
#: program's ``*.tmp``.
TEMPORARY = re.compile(
    r"(?:manifest-rank(0|[1-9][0-9]{0,8})\.json|index-rank(0|[1-9][0-9]{0,8})\.jsonl"
    r"|rank(0|[1-9][0-9]{0,8})-[0-9]{6,9}\.safetensors)(?:" + TEMPORARY_SUFFIX + r"|\.tmp)",
    re.ASCII,
)


#: What ``verify`` says repair does with an unlisted shard.
REPAIR_FIX = "`metastore verify --repair` lists it again, or removes it when listed shards hold a copy"
#: Where repair sets aside a shard it can neither list again nor prove to be a copy (a folder of the store).
QUARANTINE = "quarantine"


def leftover_rank(name: str) -> int | None:
    """The rank of a shard-like or temporary file name (:data:`SHARD_LIKE`, :data:`TEMPORARY`), else None."""
    match = SHARD_LIKE.fullmatch(name) or TEMPORARY.fullmatch(name)
    return None if match is None else int(next(g for g in match.groups() if g is not None))


#: The longest problem line ``verify`` returns, and the most items one line names.
MAX_LINE_CHARS = 400
MAX_NAMED = 5


def one_line(text: str) -> str:
    """``text`` on one printable line of at most :data:`MAX_LINE_CHARS` characters."""
    flat = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return flat if len(flat) <= MAX_LINE_CHARS else flat[: MAX_LINE_CHARS - 3] + "..."


def named(items: list[str]) -> str:
    """At most :data:`MAX_NAMED` items, then how many more."""
    more = f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else ""
    return ", ".join(items[:MAX_NAMED]) + more


def problem_of(exc: StoreError, path: Path) -> str:
    """The message of a shard error without its leading path."""
    text = str(exc)
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def check_store(directory: Path, index: StoreIndex, files: ShardFiles, checksums: bool) -> list[str]:
    """Every listed shard read whole and checked, then the unlisted shard-like and temporary files."""
    problems = []
    for s, entry in enumerate(index.shards):
        path = directory / entry.file
        try:
            data = read_shard(path, directory, index.expectation(s, checksums))
        except StoreError as exc:
            problems.append(one_line(f"{entry.file}: {problem_of(exc, path)}"))
            continue
        wrong = _wrong_sample_ids(data, index, s)
        if wrong:
            problems.append(
                one_line(f"{entry.file}: batches {named(wrong)} do not hold the sample ids the index lists")
            )
        wrong = _wrong_margins(data, index, s)
        if wrong:
            problems.append(
                one_line(f"{entry.file}: batches {named(wrong)} do not hold (B,) float32 margins the index lists")
            )
        problems += [one_line(f"{entry.file}: {line}") for line in contradicted_columns(data, entry)]
        problems += [one_line(f"{entry.file}: {line}") for line in refused_records(data, files, s)]
    problems += [one_line(line) for line in unlisted_files(directory, {e.file for e in index.shards})]
    return problems + [
        one_line(line)
        for line in vector_check.check(directory, {e.file: e.sha256 for e in index.shards}, index=index)[0]
    ]


def refused_records(data: ShardData, files: ShardFiles, shard: int) -> list[str]:
    """One line naming the records of shard ``shard`` that queries refuse (their tensors do not fit the manifest's
    layer: a shape, layout or embedding size), with the first reason; none when every record decodes and fits."""
    refused, first = [], ""
    for row in np.flatnonzero(files.index.batch["shard"] == shard):
        ref = files.ref(int(row))
        for k in range(len(ref.info["records"])):
            try:
                ref.record_at(data, k)
            except StoreError as exc:
                refused.append(f"b{ref.batch}/r{k}")
                first = first or problem_of(exc, data.path)
    if not refused:
        return []
    return [f"records {named(refused)} do not fit the manifest's layers, so queries refuse them; the first: {first}"]


def _wrong_sample_ids(data: ShardData, index: StoreIndex, shard: int) -> list[str]:
    batch = index.batch
    wrong = []
    for row in np.flatnonzero(batch["shard"] == shard):
        j, row0, size = int(batch["j"][row]), int(batch["row0"][row]), int(batch["size"][row])
        stored = data.get(meta_key(j, "sample_id"))
        listed = index.sample["sample_id"][row0 : row0 + size]
        if stored.dim() != 1 or stored.is_floating_point() or not np.array_equal(stored.long().numpy(), listed):
            wrong.append(f"b{j}")
    return wrong


def _wrong_margins(data: ShardData, index: StoreIndex, shard: int) -> list[str]:
    """Batches whose ``b{j}/meta/margin`` is not the ``(B,)`` float32 the journal's margin rows hold (NaN equal)."""
    batch = index.batch
    listed_all = index.sample.get("margin")
    wrong = []
    has_margin = (batch["meta"] >= 0) & ((batch["meta"] & META_BITS["margin"]) > 0)  # meta -1: version 1, never
    for row in np.flatnonzero((batch["shard"] == shard) & has_margin):
        j, row0, size = int(batch["j"][row]), int(batch["row0"][row]), int(batch["size"][row])
        stored = data.get(meta_key(j, "margin"))
        listed = np.full(size, np.nan, np.float32) if listed_all is None else listed_all[row0 : row0 + size]
        if stored.dtype != torch.float32 or tuple(stored.shape) != (size,):
            wrong.append(f"b{j}")
        elif not np.array_equal(stored.numpy(), listed, equal_nan=True):
            wrong.append(f"b{j}")
    return wrong


#: The journal's per-sample columns checked against the shard's ``b{j}/meta/{column}`` (``margin``: above).
CHECKED_SAMPLE_COLUMNS = ("label", "loss", "prediction")
#: The journal's batch columns checked against the shard's own description of itself (``__metadata__["index"]``).
CHECKED_BATCH_COLUMNS = ("step", "epoch", "micro_batch", "lr")
#: What ``verify`` says of a journal column that contradicts its shard: which side queries serve, which to trust.
TRUSTED = (
    "queries serve the index's values; the shard's are the ones written with it (its bytes match the line's "
    "checksum): trust the shard, the journal line was changed after it was written"
)


def contradicted_columns(data: ShardData, entry: ShardEntry) -> list[str]:
    """One line per journal column of ``entry`` whose rows contradict its shard, naming the batches and column.

    Per-sample columns (:data:`CHECKED_SAMPLE_COLUMNS`) against each batch's ``b{j}/meta/{column}``, as the
    writer derives them (``sample_columns``): a batch whose shard holds no ``(B,)`` tensor must list -1 or NaN.
    Batch columns (:data:`CHECKED_BATCH_COLUMNS`, and the capture point's name) against the shard's description
    of itself, where it has one. Equal means equal values (NaN equals NaN), never a tolerance: both sides are
    copies of the values given to ``write()``.
    """
    samples = entry.samples or {}
    sizes = entry.batches["size"].tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    wrong: dict[str, list[str]] = {}
    for j, size in enumerate(sizes):
        meta = data.read(j, meta_prefix(j))
        for key in CHECKED_SAMPLE_COLUMNS:
            listed_all = samples.get(key)
            listed = None if listed_all is None else listed_all[starts[j] : starts[j] + size]
            value = meta.get(key)
            if value is None or value.dim() != 1 or value.shape[0] != size:  # the index must say "none"
                ok = listed is None or bool((np.isnan(listed.astype(np.float64)) | (listed == -1)).all())
            else:
                stored = sample_columns([(size, {"sample_id": torch.zeros(size, dtype=torch.int64), key: value})])[key]
                ok = listed is not None and _same(listed, stored)
            if not ok:
                wrong.setdefault(key, []).append(f"b{j}")
    lines = [
        f"the index's {key} rows of batches {named(batches)} contradict the shard's b{{j}}/meta/{key} ({TRUSTED})"
        for key, batches in wrong.items()
    ]
    for key, batches in _contradicted_batches(data, entry).items():
        lines.append(
            f"the index's {key} of batches {named(batches)} contradicts the shard's own description "
            f"(__metadata__[{INFO_KEY!r}]) ({TRUSTED})"
        )
    return lines


def _contradicted_batches(data: ShardData, entry: ShardEntry) -> dict[str, list[str]]:
    """Batch columns of ``entry`` that differ from the shard's description of itself (none when it has none)."""
    try:
        info = json.loads(data.metadata[INFO_KEY])
        columns = {key: unpack(info["batches"][key], key) for key in (*CHECKED_BATCH_COLUMNS, "capture_point")}
        names = info["capture_points"]
        columns["capture_point"] = np.array([names[int(i)] for i in columns["capture_point"]], dtype=object)
    except (KeyError, TypeError, ValueError, IndexError, RecursionError):
        return {}  # no description (written before, or too large), or one repair cannot use either: not checked
    listed = {key: entry.batches[key] for key in CHECKED_BATCH_COLUMNS}
    listed["capture_point"] = np.array([entry.capture_points[int(i)] for i in entry.batches["capture_point"]], object)
    wrong: dict[str, list[str]] = {}
    for key, stored in columns.items():
        if len(stored) != len(listed[key]):
            return {"batch count": [f"{len(listed[key])} listed, {len(stored)} described"]}
        for j in range(len(stored)):
            if not _same(listed[key][j : j + 1], stored[j : j + 1]):
                wrong.setdefault(key, []).append(f"b{j}")
    return wrong


def _same(listed: np.ndarray, stored: np.ndarray) -> bool:
    """Equal values: integers exactly, floats as float64 with NaN equal to NaN, names as strings."""
    if listed.dtype.kind in "iu" and stored.dtype.kind in "iu":
        return np.array_equal(listed.astype(np.int64), stored.astype(np.int64))
    if listed.dtype.kind == "O" or stored.dtype.kind == "O":
        return listed.tolist() == stored.tolist()
    return np.array_equal(listed.astype(np.float64), stored.astype(np.float64), equal_nan=True)


def unlisted_files(directory: Path, listed: set[str]) -> list[str]:
    """One line per shard-like file the index does not list, and per temporary file (never opened)."""
    lines = []
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return [f"{directory}: cannot be listed ({exc.strerror or exc})"]
    for name in names:
        if name in listed:
            continue
        if SHARD_LIKE.fullmatch(name):
            what = _kind(directory / name)
            fix = "remove it yourself" if what == "a directory" else REPAIR_FIX
            lines.append(
                f"{ascii(name)[1:-1]}: {what} not listed in the index (a shard in flight when the run stopped, or "
                f"one replaced by compaction); ignored; {fix}"
            )
        elif TEMPORARY.fullmatch(name):
            lines.append(f"{ascii(name)[1:-1]}: a temporary file left by a stopped writer; `--repair` removes it")
    if QUARANTINE in names and _kind(directory / QUARANTINE) == "a directory":
        aside = len(os.listdir(directory / QUARANTINE))
        if aside:
            lines.append(
                f"{QUARANTINE}/: {aside} file(s) set aside by `metastore verify --repair`; "
                "see docs/store.md#compaction-and-repair"
            )
    return lines


_KIND_WORDS = {"file": "a file", "directory": "a directory", "link": "a symbolic link", "special": "a special file"}


def _kind(path: Path) -> str:
    try:
        return _KIND_WORDS[kind_of(os.lstat(path).st_mode)]
    except OSError:
        return "a file"


def fill_v1_samples(directory: Path, entries: list[ShardEntry], layers: dict[str, Any], checksums: bool) -> list[str]:
    """Read the sample rows of version 1 entries from their shards; drop (and report) shards that cannot be read.

    Version 1 kept per-sample metadata only in the shards (``b{j}/meta/{column}``), so opening
    such a store reads every shard once. Returns one problem line per shard left out.
    """
    problems = []
    for entry in [e for e in entries if e.samples is None]:
        path = directory / entry.file
        try:
            entry.samples = _v1_samples(read_shard(path, directory, expectation(entry, layers, checksums)), entry)
        except StoreError as exc:
            entries.remove(entry)
            problems.append(one_line(f"{entry.file}: {problem_of(exc, path)}; its batches are left out"))
    return problems


def _v1_samples(data: ShardData, entry: ShardEntry) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {key: [] for key in ("sample_id", "label", "loss", "prediction")}
    for j, size in enumerate(entry.batches["size"].tolist()):
        meta = data.read(j, meta_prefix(j))
        ids = meta.get("sample_id")
        if ids is None or ids.dim() != 1 or ids.is_floating_point() or ids.shape[0] != size:
            raise StoreError(f"{data.path}: tensor b{j}/meta/sample_id must be ({size},) integer sample ids")
        parts["sample_id"].append(ids.long().numpy())
        for key in ("label", "loss", "prediction"):
            value = meta.get(key)
            scalar = value is not None and value.dim() == 1 and value.shape[0] == size
            fill = np.nan if key == "loss" or (value is not None and value.is_floating_point()) else -1
            parts[key].append(value.double().numpy() if scalar and value is not None else np.full(size, fill))
    samples = {"sample_id": np.concatenate(parts["sample_id"])}
    for key in ("label", "loss", "prediction"):
        column = np.concatenate(parts[key])
        integral = key != "loss" and not np.isnan(column).any() and np.array_equal(column, np.round(column))
        samples[key] = column.astype(np.int64 if integral else (np.float32 if key == "loss" else np.float64))
    return samples
