"""The manifest: the JSON file a reader trusts, written atomically, one per process rank.

A run directory holds ``manifest-rank{r}.json`` and ``rank{r}-{n:06d}.safetensors``
shards. A shard is listed only once it is whole on disk, so a killed run leaves a
readable store that lost at most the shard in flight. Schema (version 1; every field, the
versioning rules and what a reader checks are in docs/format.md)::

    {"format": "metastore", "schema_version": 1, "rank": 0,
     "config": {...},                                   # run configuration, free-form
     "layers": {layer: {"params": {role: name}, "param_shapes": {role: [..]}, "layout": "out_in"}},
     "shards": [{"file": "rank0-000000.safetensors", "bytes": 123, "sha256": "...",
                 "encoding": "fp16", "rows": 32, "steps": [0, 3], "sample_ids": [0, 31],
                 "batches": [{"capture_point": "train", "step": 0, "epoch": 0, "micro_batch": 0,
                              "rank": 0, "size": 8, "lr": 0.1,
                              "records": [{"layer": "fc", "kind": "outer", "rows": 8,
                                           "bytes": 640, "dense_bytes": 4096}]}]}]}

In a shard, record tensors are named ``b{j}/r{k}/{tensor}`` (batch ``j`` of the shard,
record ``k`` of the batch) and per-sample metadata ``b{j}/meta/{column}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

FORMAT = "metastore"
SCHEMA_VERSION = 1
MANIFEST_PATTERN = re.compile(r"^manifest-rank(\d+)\.json$")


class StoreError(ValueError):
    """A user mistake about a store (not a store, unknown capture point, sample, step or layer),
    or a damaged or malformed store (a checksum mismatch, a hostile manifest or shard)."""


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.json"


def shard_name(rank: int, index: int) -> str:
    return f"rank{rank}-{index:06d}.safetensors"


def record_key(batch: int, record: int, tensor: str) -> str:
    return f"b{batch}/r{record}/{tensor}"


def meta_key(batch: int, column: str) -> str:
    return f"b{batch}/meta/{column}"


def new_manifest(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "rank": rank,
        "config": config,
        "layers": {},
        "shards": [],
    }


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename.

    On failure (a full disk) the temporary file is removed and ``path`` is left as it was.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Rewrite the rank's manifest atomically. Compact JSON: it is rewritten after every shard, and
    the indented form (Python's pure encoder) took 66 ms for a 54-shard BERT store, the compact
    one (the C encoder) 12 ms."""
    text = json.dumps(manifest, separators=(",", ":"))
    atomic_write_bytes(directory / manifest_name(manifest["rank"]), text.encode())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_problem(path: Path, entry: dict[str, Any], checksums: bool = True) -> str | None:
    """What is wrong with a listed shard on disk, in words, or ``None`` when it matches its manifest entry.

    Checks, in order: a plain file inside the run directory (no link), present, ``entry["bytes"]``
    long, and (with ``checksums``) hashing to ``entry["sha256"]``. The one check both the reader
    (which raises) and ``verify`` (which lists) use.
    """
    try:
        if path.is_symlink() or path.resolve().parent != path.parent.resolve():
            return "is a link or leads outside the run directory; not read"
        if not path.is_file():
            return "listed in the manifest but missing on disk"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"size mismatch, {size} bytes on disk but {entry['bytes']} in the manifest (truncated or rewritten)"
        actual = file_sha256(path) if checksums else None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc}); check its permissions"
    if actual is not None and actual != entry["sha256"]:
        expected = entry["sha256"]
        return f"checksum mismatch, sha256 {actual} on disk but {expected} in the manifest (the file is damaged)"
    return None


def load_manifest(path: Path) -> dict[str, Any]:
    """Read and check one manifest; raise ``ValueError`` naming the file and the problem."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"cannot read manifest {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f'{path} is not a metastore manifest (no "format": "{FORMAT}")')
    version: Any = manifest.get("schema_version")  # JSON: checked next
    if not _is_int(version) or version < 1:
        raise ValueError(f"{path} has an invalid schema version {version!r} (a positive integer is expected)")
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema version {version}; this version of metastore_plugins reads "
            f"version {SCHEMA_VERSION} and older: upgrade metastore_plugins"
        )
    check_manifest(manifest, path)
    return manifest


# -- structure checks: a reader trusts nothing a manifest says before these pass -------------

SHARD_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")
KINDS = ("outer", "embedding", "dense")
LAYOUTS = ("out_in", "in_out")
ENCODING_NAMES = ("fp32", "fp16", "bf16", "int8")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _need(ok: bool, path: Path, where: str, what: str) -> None:
    if not ok:
        raise ValueError(f"malformed manifest {path}: {where} {what}")


def check_shard_file(name: Any, path: Path, where: str) -> None:
    """A shard ``file`` must be a plain file name inside the run directory (no ``..``, ``/``, drive)."""
    _need(isinstance(name, str), path, where, f"must be a file name string; got {name!r}")
    _need(
        SHARD_FILE.match(name) is not None and name not in (".", ".."),
        path,
        where,
        f"{name!r} is not a plain *.safetensors file name in the run directory (paths and '..' are refused)",
    )


def check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Check the types of every field a reader uses; raise ``ValueError`` naming the file and the field."""
    _need(_is_int(manifest.get("rank")) and manifest["rank"] >= 0, path, '"rank"', "must be a non-negative integer")
    _need(isinstance(manifest.get("config", {}), dict), path, '"config"', "must be an object")
    layers: Any = manifest.get("layers")  # JSON: checked next
    _need(isinstance(layers, dict), path, '"layers"', "must be an object")
    for name, layer in layers.items():
        where = f"layers[{name!r}]"
        _need(isinstance(layer, dict), path, where, "must be an object")
        params, shapes = layer.get("params"), layer.get("param_shapes")
        _need(
            isinstance(params, dict) and all(isinstance(v, str) for v in params.values()),
            path,
            where,
            '"params" must map roles to names',
        )
        _need(
            isinstance(shapes, dict) and set(shapes) == set(params),
            path,
            where,
            '"param_shapes" must give a shape per role',
        )
        for role, shape in shapes.items():
            good = isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
            _need(good, path, f"{where}.param_shapes[{role!r}]", f"must be a list of sizes; got {shape!r}")
        _need(layer.get("layout", "out_in") in LAYOUTS, path, where, f'"layout" must be one of {LAYOUTS}')
    shards: Any = manifest.get("shards")
    _need(isinstance(shards, list), path, '"shards"', "must be a list")
    for i, shard in enumerate(shards):
        where = f"shards[{i}]"
        _need(isinstance(shard, dict), path, where, "must be an object")
        check_shard_file(shard.get("file"), path, f"{where}.file")
        _need(_is_int(shard.get("bytes")) and shard["bytes"] >= 0, path, f"{where}.bytes", "must be a byte count")
        sha = shard.get("sha256")
        _need(
            isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) is not None,
            path,
            f"{where}.sha256",
            "must be 64 hex digits",
        )
        _need(shard.get("encoding") in ENCODING_NAMES, path, f"{where}.encoding", f"must be one of {ENCODING_NAMES}")
        batches: Any = shard.get("batches")
        _need(isinstance(batches, list), path, f"{where}.batches", "must be a list")
        for j, batch in enumerate(batches):
            _check_batch(batch, layers, path, f"{where}.batches[{j}]")


def _check_batch(batch: Any, layers: dict[str, Any], path: Path, where: str) -> None:
    _need(isinstance(batch, dict), path, where, "must be an object")
    _need(isinstance(batch.get("capture_point"), str), path, f"{where}.capture_point", "must be a string")
    for key in ("step", "epoch", "micro_batch", "rank", "size"):
        _need(_is_int(batch.get(key)), path, f"{where}.{key}", f"must be an integer; got {batch.get(key)!r}")
    _need(batch["size"] >= 0, path, f"{where}.size", "must be non-negative")
    _need(batch.get("lr") is None or _is_number(batch["lr"]), path, f"{where}.lr", "must be a number or null")
    records = batch.get("records")
    _need(isinstance(records, list), path, f"{where}.records", "must be a list")
    for k, record in enumerate(records):
        at = f"{where}.records[{k}]"
        _need(isinstance(record, dict), path, at, "must be an object")
        _need(record.get("layer") in layers, path, f"{at}.layer", f'{record.get("layer")!r} is not in "layers"')
        _need(record.get("kind") in KINDS, path, f"{at}.kind", f"must be one of {KINDS}")
        for key in ("rows", "bytes", "dense_bytes"):
            _need(_is_int(record.get(key, 0)), path, f"{at}.{key}", "must be an integer")


def find_manifests(directory: Path) -> list[Path]:
    """The rank manifests of a run directory, in rank order.

    Raises:
        StoreError: when the directory exists but cannot be listed (permissions).
    """
    try:
        entries = list(directory.iterdir()) if directory.is_dir() else []
    except OSError as exc:
        raise StoreError(f"cannot read the directory {directory}: {exc.strerror or exc}") from exc
    found = [(int(match.group(1)), p) for p in entries if (match := MANIFEST_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]
