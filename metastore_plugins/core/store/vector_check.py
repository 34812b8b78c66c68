"""``verify`` and ``verify --repair`` of a store's nearest-gradient index files (:mod:`.vector_files`).

:func:`check` is ``verify``'s part (and ``inspect``'s descriptions), :func:`repair` ``verify --repair``'s:
the index is a cache, so what is damaged or stale is removed, never mended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metastore_plugins.core.store.file_kinds import temporary_target
from metastore_plugins.core.store.files import StoreDir, StoreError
from metastore_plugins.core.store.vector_files import (
    FOLDER,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OWN_NAME,
    decode_manifest,
    encode_manifest,
    part_binding_problem,
    parts_digest,
    read,
    read_checked,
)


def check(store_dir: Path, shard_sha256: dict[str, str], files: bool = True) -> tuple[list[str], list[str]]:
    """``(problems, descriptions)`` of every index in ``vector_index/`` (for ``verify`` and ``inspect``).

    Problems: a damaged manifest, a part or search file missing, a link or not regular, or
    whose bytes do not match its recorded sha256. A part whose shard changed or went away is
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
        current = [p for p in parts if shard_sha256.get(str(p.get("shard"))) == p.get("shard_sha256")]
        stale = len(parts) - len(current)
        # a stale part (or a search file over stale parts) is rebuilt whatever its bytes: not damage
        checked = [*current, *([ann] if isinstance(ann, dict) and not stale else [])]
        for entry in checked if files else []:
            problem = _file_problem(store_dir, entry)
            if problem:
                problems.append(f"{FOLDER}/{entry.get('file')}: {problem}; the next query rebuilds it")
        rows = sum(int(p.get("rows", 0)) for p in parts)
        kind = ann_description(ann)
        lines.append(
            f"{manifest.get('capture_point')!s:<20} {rows:,} rows of {len(manifest.get('layers') or [])} layers x "
            f"{manifest.get('dim')}^2, {kind}, "
            f"{len(parts)} parts"
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


def _file_problem(store_dir: Path, entry: dict[str, Any]) -> str | None:
    name, expected = entry.get("file"), entry.get("sha256")
    if not isinstance(name, str) or not isinstance(expected, str):
        return "listed without a file name or sha256"
    try:
        data = read_checked(store_dir, name, expected, 1 << 40, "vector index file")
    except StoreError as exc:
        return _tail(exc, store_dir / FOLDER / name)
    return part_binding_problem(data, entry) if "shard" in entry else None


def _tail(exc: StoreError, path: Path) -> str:
    text = str(exc)
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def repair(store_dir: Path, shard_sha256: dict[str, str]) -> list[str]:
    """Remove what of ``vector_index/`` is damaged, stale or left over; one line per thing removed.

    The index is a cache: a part or search file that is damaged (missing, a link, not regular, its
    sha256 wrong) or stale (its shard changed or went away) is removed and dropped from its manifest,
    whose other parts stay (the next query rebuilds what is missing); a damaged manifest is removed
    with its files (the next ``--index build`` rebuilds the index); temporaries of a stopped build and
    files no manifest lists are removed; a link where the folder belongs is removed (never its
    target). Shards are never touched. ``shard_sha256``: listed shard -> its sha256.
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
                repaired, lines = _drop_unsound(store_dir, manifest, shard_sha256, keep)
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
    store_dir: Path, manifest: dict[str, Any], shard_sha256: dict[str, str], keep: set[str]
) -> tuple[dict[str, Any], list[str]]:
    """The manifest without its stale and damaged files, and a line for each (the caller removes the files:
    the sound ones are added to ``keep``)."""
    done, parts = [], []
    for part in manifest["parts"]:
        if shard_sha256.get(str(part.get("shard"))) != part.get("shard_sha256"):
            problem: str | None = "stale (its shard changed or went away)"
        else:
            problem = _file_problem(store_dir, part)
        if problem is None:
            parts.append(part)
            keep.add(str(part["file"]))
        else:
            done.append(f"{FOLDER}/{part.get('file')}: {problem}; removed (the next query rebuilds it)")
    ann = manifest.get("ann")
    if isinstance(ann, dict):
        problem = "built over other parts" if ann.get("parts") != parts_digest(parts) else _file_problem(store_dir, ann)
        if problem is None:
            keep.add(str(ann["file"]))
        else:
            done.append(f"{FOLDER}/{ann.get('file')}: {problem}; removed (the next query rebuilds it)")
            ann = None
    return {**manifest, "parts": parts, "ann": ann}, done
