"""The manifest: the JSON file a reader trusts, written atomically, one per process rank.

A run directory holds ``manifest-rank{r}.json`` and ``rank{r}-{n:06d}.safetensors``
shards. A shard is listed only once it is whole on disk, so a killed run leaves a
readable store that lost at most the shard in flight. Schema (version 1)::

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


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.json"


def shard_name(rank: int, index: int) -> str:
    return f"rank{rank}-{index:06d}.safetensors"


def record_key(batch: int, record: int, tensor: str) -> str:
    return f"b{batch}/r{record}/{tensor}"


def meta_key(batch: int, column: str) -> str:
    return f"b{batch}/meta/{column}"


def new_manifest(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "rank": rank, "config": config, "layers": {}, "shards": []}


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
    """Write ``data`` to ``path`` through a temporary file, fsync and rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(directory / manifest_name(manifest["rank"]), json.dumps(manifest, indent=1).encode())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(path: Path) -> dict[str, Any]:
    """Read and check one manifest; raise ``ValueError`` naming the file and the problem."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read manifest {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a metastore manifest (no \"format\": \"{FORMAT}\")")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema version {version}; this version of metastore_plugins reads "
            f"version {SCHEMA_VERSION}: upgrade metastore_plugins"
        )
    return manifest


def find_manifests(directory: Path) -> list[Path]:
    """The rank manifests of a run directory, in rank order."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := MANIFEST_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]
