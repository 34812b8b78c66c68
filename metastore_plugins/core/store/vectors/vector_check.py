"""``verify`` and ``verify --repair`` of a store's nearest-gradient index files (:mod:`.vector_files`).

:func:`check` is ``verify``'s part (and ``inspect``'s descriptions), :func:`repair` ``verify --repair``'s:
the index is a cache, so what is damaged or stale is removed, never mended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.file_kinds import temporary_target
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.index import StoreIndex
from metastore_plugins.core.store.vectors.vector_files import (
    FOLDER,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OWN_NAME,
    ann_bytes_problem,
    ann_cap,
    decode_manifest,
    encode_manifest,
    part_binding_problem,
    parts_digest,
    read,
    read_checked,
)
from metastore_plugins.core.store.vectors.vector_maps import open_part

#: A part's rows as its shard holds them: ``(sample ids (n,), learning-rate weights (n,))``, or None when unknown.
Rows = tuple[np.ndarray, np.ndarray]


def listed_rows(index: StoreIndex, shard: str, capture_point: Any) -> Rows | None:
    """The sample ids and learning-rate weights (1 where none was recorded) of the rows a part of ``shard`` at
    ``capture_point`` holds, in selection order, from the store's own index (not the part's manifest)."""
    names = [entry.file for entry in index.shards]
    if shard not in names or capture_point not in index.capture_point_names or not len(index):
        return None
    mine = (index.batch["shard"] == names.index(shard)) & (
        index.batch["capture_point"] == index.capture_point_names.index(capture_point)
    )
    batches = np.flatnonzero(mine)
    rows, at = index.rows(batches)
    lr = index.batch["lr"][batches]
    return index.sample["sample_id"][rows], np.where(np.isnan(lr), 1.0, lr)[at]


def rows_problem(tensors: dict[str, Any], rows: Rows, width: int) -> str | None:
    """Why a sound part's tensors are not the rows of its shard (``rows``: :func:`listed_rows`), or None: its
    ``sample_id`` and ``lr`` must be the shard's own, in order, and its ``vector`` ``(n, width)`` float32. A
    manifest re-signed over another shard's part, or over permuted ids, is caught here."""
    ids, lr, vector = tensors.get("sample_id"), tensors.get("lr"), tensors.get("vector")
    n = len(rows[0])
    if vector is None or tuple(vector.shape) != (n, width) or vector.dtype != np.float32:
        return f"its vectors are not the ({n}, {width}) float32 its shard's rows make"
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or not np.array_equal(ids, rows[0]):
        return "its sample ids are not its shard's, in order"
    if not isinstance(lr, np.ndarray) or lr.dtype != np.float64 or not np.array_equal(lr, rows[1]):
        return "its learning rates are not its shard's batches'"
    return None


def check(
    store_dir: Path, shard_sha256: dict[str, str], files: bool = True, index: StoreIndex | None = None
) -> tuple[list[str], list[str]]:
    """``(problems, descriptions)`` of every index in ``vector_index/`` (for ``verify`` and ``inspect``).

    Problems: a damaged manifest, a part or search file missing, a link or not regular, or
    whose bytes do not match its recorded sha256, or (given the store's ``index``) a part whose rows are not
    its shard's. A part whose shard changed or went away is
    stale, not damaged: the next query rebuilds it. ``shard_sha256``: listed shard -> its sha256.
    ``files=False`` reads the manifests only (the descriptions, and damaged manifests).
    """
    problems: list[str] = []
    lines: list[str] = []
    where = store_dir / FOLDER
    try:
        with StoreDir(store_dir) as store:
            if not store.exists(FOLDER):
                return [], []
            with store.subdir(FOLDER) as folder:
                names = sorted(folder.listdir())
    except StoreError as exc:
        return [f"{exc}; the nearest-gradient index is not used (deleting {FOLDER}/ is always safe)"], []
    problems += [
        f"{FOLDER}/{ascii(name)[1:-1]}: a temporary file left by a stopped index build; `--repair` or the next "
        "query removes it"
        for name in names
        if temporary_target(name) is not None and files
    ]
    for name in (n for n in names if MANIFEST_NAME.fullmatch(n)):
        try:
            manifest = decode_manifest(read(store_dir, name, MAX_MANIFEST_BYTES, "vector index manifest"))
        except StoreError as exc:
            problems.append(f"{FOLDER}/{name}: {_tail(exc, where / name)}; the next query rebuilds the index")
            continue
        parts, ann = manifest["parts"], manifest.get("ann")
        current = [p for p in parts if shard_sha256.get(p["shard"]) == p["shard_sha256"]]
        stale = len(parts) - len(current)
        for entry in current if files else []:  # a stale part is rebuilt whatever its bytes: not damage
            problem = _file_problem(store_dir, manifest, entry, index)
            if problem:
                problems.append(f"{FOLDER}/{entry['file']}: {problem}; the next query rebuilds it")
        if isinstance(ann, dict) and not stale and files:  # a search file over stale parts is rebuilt too
            problem = _ann_problem(store_dir, manifest, ann)
            if problem:
                problems.append(f"{FOLDER}/{ann['file']}: {problem}; the next query rebuilds it")
        rows = sum(p["rows"] for p in parts)
        lines.append(
            f"{ascii(manifest['capture_point'])[1:-1]:<20} {rows:,} rows of {len(manifest['layers'])} layers x "
            f"{manifest['dim']}^2, {ann_description(ann)}, {len(parts)} parts"
            + (f" ({stale} stale: rebuilt by the next query)" if stale else "")
            + (" (one rank's shards)" if manifest.get("shards") else "")
        )
    return problems, lines


def ann_description(ann: Any) -> str:
    """How a manifest's search structure searches, in words (``inspect``)."""
    if not isinstance(ann, dict):
        return "flat"
    if ann.get("kind") == "reduced":
        return f"reduced ({ann.get('reduced')} principal directions, {ann.get('candidates')} candidates rescored)"
    return f"{ann.get('kind')} (nlist {ann.get('nlist')}, nprobe {ann.get('nprobe')})"


def _width(manifest: dict[str, Any]) -> int:
    return len(manifest["layers"]) * manifest["dim"] ** 2


def _file_problem(
    store_dir: Path, manifest: dict[str, Any], entry: dict[str, Any], index: StoreIndex | None
) -> str | None:
    """Why a current part is not sound and bound to its shard (its rows its shard's, given the store's index)."""
    try:
        tensors = open_part(
            store_dir,
            entry["file"],
            entry["sha256"],
            entry["rows"] * (4 * _width(manifest) + 16) + 4096,
            "vector index file",
        )
    except StoreError as exc:
        return _tail(exc, store_dir / FOLDER / entry["file"])
    problem = part_binding_problem(tensors["__metadata__"], entry)
    rows = None if index is None else listed_rows(index, entry["shard"], manifest["capture_point"])
    if problem is None and rows is not None:
        problem = rows_problem(tensors, rows, _width(manifest))
    return problem


def _ann_problem(store_dir: Path, manifest: dict[str, Any], ann: dict[str, Any]) -> str | None:
    """Why a search file is not sound and the structure its entry describes (over the manifest's parts)."""
    if ann["parts"] != parts_digest(manifest["parts"]) or ann["rows"] != sum(p["rows"] for p in manifest["parts"]):
        return "built over other parts"
    width, path = _width(manifest), store_dir / FOLDER / ann["file"]
    try:
        data = read_checked(store_dir, ann["file"], ann["sha256"], ann_cap(ann["rows"], width), "vector index file")
    except StoreError as exc:
        return _tail(exc, path)
    return ann_bytes_problem(data, ann, width)


def _tail(exc: StoreError, path: Path) -> str:
    text = str(exc)
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def repair(store_dir: Path, shard_sha256: dict[str, str], index: StoreIndex | None = None) -> list[str]:
    """Remove what of ``vector_index/`` is damaged, stale or left over; one line per thing removed.

    The index is a cache: a part or search file that is damaged (missing, a link, not regular, its
    sha256 wrong) or stale (its shard changed or went away) is removed and dropped from its manifest,
    whose other parts stay (the next query rebuilds what is missing); a damaged manifest is removed
    with its files (the next ``--index build`` rebuilds the index); temporaries of a stopped build and
    files no manifest lists are removed; a link where the folder belongs is removed (never its
    target). Shards are never touched. ``shard_sha256``: listed shard -> its sha256; ``index``: the store's index
    (a part whose rows are not its shard's is removed too).
    """
    done: list[str] = []
    with StoreDir(store_dir) as store:
        kind = store.kind(FOLDER)
        if kind is None:
            return []
        if kind != "directory":
            store.remove(FOLDER)
            return [f"{FOLDER}: a {kind} where the index folder belongs; removed (the next query rebuilds the index)"]
        with store.subdir(FOLDER) as folder:
            names = sorted(folder.listdir())
            keep: set[str] = set()
            for name in (n for n in names if MANIFEST_NAME.fullmatch(n) and folder.kind(n) == "file"):
                keep.add(name)
                try:
                    manifest = decode_manifest(folder.read(name, MAX_MANIFEST_BYTES, "vector index manifest"))
                except StoreError as exc:
                    keep.discard(name)
                    done.append(f"{FOLDER}/{name}: {_tail(exc, store_dir / FOLDER / name)}; removed with its files")
                    continue
                repaired, lines = _drop_unsound(store_dir, manifest, shard_sha256, keep, index)
                if repaired != manifest:
                    folder.atomic_write(name, encode_manifest(repaired))
                done += lines
            for name in names:
                target = temporary_target(name) or name
                if name in keep or not OWN_NAME.fullmatch(target):
                    continue
                if folder.kind(name) == "directory":
                    done.append(f"{FOLDER}/{ascii(name)[1:-1]}: a directory where an index file belongs; remove it")
                    continue
                link = folder.kind(name) == "link"
                folder.remove(name, missing_ok=True)
                if any(line.startswith(f"{FOLDER}/{name}: ") for line in done):
                    continue  # said with its manifest
                why = "a temporary file left by a stopped index build" if target != name else "listed by no manifest"
                why = "a symbolic link (its target left as it is)" if link else why
                done.append(f"{FOLDER}/{ascii(name)[1:-1]}: {why}; removed")
    return done


def _drop_unsound(
    store_dir: Path, manifest: dict[str, Any], shard_sha256: dict[str, str], keep: set[str], index: StoreIndex | None
) -> tuple[dict[str, Any], list[str]]:
    """The manifest without its stale and damaged files, and a line for each (the caller removes the files:
    the sound ones are added to ``keep``)."""
    done, parts = [], []
    for part in manifest["parts"]:
        if shard_sha256.get(part["shard"]) != part["shard_sha256"]:
            problem: str | None = "stale (its shard changed or went away)"
        else:
            problem = _file_problem(store_dir, manifest, part, index)
        if problem is None:
            parts.append(part)
            keep.add(part["file"])
        else:
            done.append(f"{FOLDER}/{part['file']}: {problem}; removed (the next query rebuilds it)")
    repaired, ann = {**manifest, "parts": parts}, manifest.get("ann")
    if isinstance(ann, dict):
        problem = _ann_problem(store_dir, repaired, ann)
        if problem is None:
            keep.add(ann["file"])
        else:
            done.append(f"{FOLDER}/{ann['file']}: {problem}; removed (the next query rebuilds it)")
            ann = None
    return {**repaired, "ann": ann}, done
