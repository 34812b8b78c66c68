"""A shard's description of itself, so that a lost journal line can be rebuilt from the shard alone.

The writer and compaction put what the shard's journal line says beyond the shard's own tensors
(its batch and record columns, its capture-point and layer names, and the specs of those layers)
in the safetensors header: ``__metadata__["index"]``, compact JSON (an additive header key:
readers that do not know it ignore it). :func:`entry_from_shard` rebuilds the shard's entry from
it and from the shard's ``b{j}/meta/...`` tensors, checked exactly as a journal line is. The
description is left out when it would make the header larger than a reader allows
(:func:`header_room`); such a shard, like one written before descriptions existed, can be kept
or set aside, never re-listed.

Also here: reading a shard no line lists (its keys taken from its own header), and one digest
per batch of a shard (:func:`batch_prints`), by which repair tells a compaction's leftover (every
batch held byte for byte by a listed shard) from data no line lists.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.errors import JournalError, StoreError
from metastore_plugins.core.records import meta_prefix
from metastore_plugins.core.store.files import open_regular
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import (
    BATCH_FIELDS,
    RECORD_FIELDS,
    ShardEntry,
    entry_from_json,
    sample_columns,
)
from metastore_plugins.core.store.shards.index import expectation
from metastore_plugins.core.store.shards.journal import pack, unpack
from metastore_plugins.core.store.shards.shardread import DIGESTS, ShardData, ShardExpectation, read_shard

#: The header metadata key of a shard's description, and the description's own version.
INFO_KEY = "index"
INFO_VERSION = 1
#: The largest header of a shard no line lists that is read (a 64 MiB shard of a tiny MLP has a few MiB).
MAX_UNLISTED_HEADER = 64 * 2**20
_BATCH_KEY = re.compile(r"b(0|[1-9][0-9]{0,9})/(.+)", re.ASCII | re.DOTALL)


def header_room(keys: Iterable[tuple[str, int]]) -> int:
    """Bytes of header metadata a shard with these ``(tensor key, ndim)`` can carry and stay within the
    header a reader allows (:func:`~metastore_plugins.core.store.shards.shard_header.header_cap`: 64 KiB plus
    ``256 + 6 len(key)`` per key): what each key's allowance leaves after its own entry at its largest
    (13-digit sizes and offsets), and half the 64 KiB for the rest of ``__metadata__`` and padding."""
    return 2**15 + sum(max(0, 150 + 5 * len(key) - 14 * ndim) for key, ndim in keys)


def describe(entry: ShardEntry, layers: dict[str, dict[str, Any]], keys: Iterable[tuple[str, int]]) -> dict[str, str]:
    """``{INFO_KEY: text}`` for the header metadata of ``entry``'s shard, or ``{}`` when it does not fit."""
    info = {
        "v": INFO_VERSION,
        "rank": entry.rank,
        "capture_points": entry.capture_points,
        "layers": entry.layers,
        "specs": {name: layers[name] for name in entry.layers},
        "batches": {key: pack(entry.batches[key]) for key in BATCH_FIELDS},
        "records": {key: pack(entry.records[key]) for key in RECORD_FIELDS},
    }
    text = json.dumps(info, separators=(",", ":"))
    fits = len(json.dumps(text)) + len(INFO_KEY) + 4 <= header_room(keys)  # as the header quotes it, with ',"":'
    return {INFO_KEY: text} if fits else {}


def read_unlisted(directory: Path, name: str) -> tuple[ShardData, str]:
    """A shard no journal line lists, read whole and checked against its own header; ``(data, sha256)``.

    Raises :class:`StoreError` naming the file when it is not a sound safetensors file of the store.
    """
    path = directory / name
    fd, opened = open_regular(path, directory)
    digest = hashlib.sha256()
    try:
        with io.FileIO(fd, "rb", closefd=False) as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= length <= min(opened.st_size - 8, MAX_UNLISTED_HEADER):
                raise StoreError(
                    f"{path}: not a readable safetensors file (no header of at most {opened.st_size} bytes)"
                )
            text = handle.read(length)
            digest.update(head + text)
            while block := handle.read(1 << 20):
                digest.update(block)
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    try:
        raw = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(f"{path}: not a readable safetensors file (header: {exc})") from exc
    if not isinstance(raw, dict):
        raise StoreError(f"{path}: not a readable safetensors file (the header is not a JSON object)")
    keys = frozenset(key for key in raw if key != "__metadata__")
    sha256 = digest.hexdigest()
    return read_shard(path, directory, ShardExpectation(opened.st_size, sha256, keys)), sha256


def entry_from_shard(
    directory: Path, name: str, rank: int, read: tuple[ShardData, str] | None = None
) -> tuple[ShardEntry, dict[str, dict[str, Any]]]:
    """The journal entry of shard ``name`` rebuilt from the shard alone, and the specs of its layers; ``read``: what
    :func:`read_unlisted` gave for it, when the caller read it already.

    Raises :class:`StoreError` naming the file when the shard does not describe itself (written
    before descriptions, or its description did not fit) or what it says does not hold.
    """
    path = directory / name
    data, sha256 = read_unlisted(directory, name) if read is None else read
    text = data.metadata.get(INFO_KEY)
    if text is None:
        raise StoreError(
            f"{path}: does not describe its batches (written before metastore_plugins kept a description in "
            "each shard, or its description did not fit the header), so its journal line cannot be rebuilt"
        )
    try:
        info = json.loads(text)
        if not (isinstance(info, dict) and info.get("v") == INFO_VERSION):
            raise JournalError(f"is not a version {INFO_VERSION} description")
        if info.get("rank") != rank:
            raise JournalError(f"describes a shard of rank {ascii(info.get('rank'))[:20]}, not of rank {rank}")
        specs = info["specs"]
        mf.check_layers(specs, path)
        sizes = unpack(info["batches"]["size"], "batches.size").astype(np.int64)
        if sizes.size == 0 or sizes.min() < 0 or int(sizes.sum()) * 8 > data.nbytes:
            raise JournalError("batches.size must give each batch's samples, 8 bytes of sample id each")
        metas = [_meta(data, j, int(size)) for j, size in enumerate(sizes.tolist())]
        raw = {
            "file": name,
            "bytes": data.nbytes,
            "sha256": sha256,
            "xxh3_128": DIGESTS["xxh3_128"](data.buffer()),  # the bytes just checked against sha256
            "encoding": data.metadata.get("encoding"),
            **{key: info[key] for key in ("capture_points", "layers", "batches", "records")},
            "samples": {key: pack(value) for key, value in sample_columns(metas).items()},
        }
        entry = entry_from_json(raw, rank, specs)
    except (JournalError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise StoreError(f"{path}: its description cannot be trusted ({str(exc)[:200]})") from exc
    read_shard(path, directory, expectation(entry, specs, True))  # exactly the keys the description implies
    return entry, {layer: specs[layer] for layer in entry.layers}


def _meta(data: ShardData, j: int, size: int) -> tuple[int, dict[str, torch.Tensor]]:
    meta = data.read(j, meta_prefix(j))
    ids = meta.get("sample_id")
    if ids is None or ids.dim() != 1 or ids.is_floating_point() or ids.shape[0] != size:
        raise JournalError(f"tensor b{j}/meta/sample_id must be ({size},) integer sample ids")
    if any(value.dim() == 0 or value.shape[0] != size for value in meta.values()):
        raise JournalError(f"every b{j}/meta/ tensor must hold {size} samples")
    return size, meta


def batch_prints(data: ShardData) -> list[bytes] | None:
    """A digest per batch ``b{j}`` of a shard, over its tensors' names (``b{j}/`` left out), dtypes, shapes and
    bytes: equal for a batch and its byte-for-byte copy under another number. None when a key is not ``b{j}/...``
    or the batch numbers are not ``0..n-1``."""
    by_batch: dict[int, list[tuple[str, str]]] = {}
    for key in data.keys():
        match = _BATCH_KEY.fullmatch(key)
        if match is None:
            return None
        by_batch.setdefault(int(match[1]), []).append((match[2], key))
    if sorted(by_batch) != list(range(len(by_batch))):
        return None
    prints = []
    for j in range(len(by_batch)):
        digest = hashlib.sha256()
        for rest, key in sorted(by_batch[j]):
            dtype, shape, raw = data.stored(key)
            digest.update(f"{len(rest)}:{rest}|{dtype}|{list(shape)}|{len(raw)}\n".encode())
            digest.update(raw)
        prints.append(digest.digest())
    return prints
