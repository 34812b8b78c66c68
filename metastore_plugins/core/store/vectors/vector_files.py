"""The files of a store's nearest-gradient index, ``<store>/vector_index/`` (bytes only: no FAISS, no queries).

One index per (capture point, sketch ``dim``, seed, layers in order), named by a hash of them:

- ``manifest-{key}.json`` (a rank's index over its own shards: ``"shards"``, the sha256 of their names, in
  its head and its key; its parts are the whole index's files): one line, the manifest's compact JSON, a
  space, its CRC-32 (8 hex digits)
  and ``\\n``; replaced whole (atomically) after each build. It lists the index's **parts**, one
  per shard holding batches of the capture point: ``{"file", "shard", "shard_sha256", "rows",
  "sha256"}``, and the **search structure** ``"ann"`` (``null`` for a flat index):
  ``{"file", "kind", "metric", "rows", "sha256", "parts"}`` (``parts``: the sha256 of the parts list it
  was built over) with ``"nlist", "nprobe"`` (kind ``"ivf"``) or ``"reduced", "candidates"`` (kind
  ``"reduced"``: principal directions, rows rescored per query).
- ``part-{key}-{shard stem}.safetensors``: the part's vectors (see
  :mod:`metastore_plugins.core.analysis.vector_index`), written by :func:`part_bytes`: the same
  rows give the same bytes, whoever writes them (a query, or a run's close: the write side).
- ``ann-{key}.faiss``: the serialized FAISS index (``faiss.serialize_index``), read as bytes
  and deserialized from them, never opened by path; for kind ``"reduced"`` it holds the projection
  on the principal directions and the reduced rows.
- ``manifests.lock``: an empty file, locked (POSIX ``lockf``) by the write side while it adds a
  part to a manifest (:func:`add_parts`): ranks closing at once never lose each other's
  entries. A query-time build does not take it (a part it leaves out is rebuilt, see
  docs/store.md).

A part is *current* when its shard is still listed with the sha256 it records, and *sound*
when its bytes hash to the sha256 the manifest records. Everything goes through
:class:`~metastore_plugins.core.store.files.StoreDir`: no link is followed, reads are bounded,
writes atomic. The shard journal is never written. ``verify`` and ``verify --repair`` of these files are
:mod:`.vector_check`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.file_kinds import temporary_target
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.shardfile import header_bytes, tensor_layout

FOLDER = "vector_index"
FORMAT, VERSION = "metastore-vector-index", 1
#: The largest manifest a reader accepts (a part line is about 250 bytes: a million shards; parsed in about 1 GB).
MAX_MANIFEST_BYTES = 1 << 28
MANIFEST_NAME = re.compile(r"manifest-[0-9a-f]{16}\.json", re.ASCII)


def key_hash(capture_point: str, dim: int, seed: int, layers: list[str]) -> str:
    """16 hex digits naming an index's files."""
    return hashlib.sha256(json.dumps([capture_point, dim, seed, list(layers)]).encode()).hexdigest()[:16]


def manifest_name(key: str) -> str:
    return f"manifest-{key}.json"


def part_name(key: str, shard: str) -> str:
    """The file of the part of index ``key`` over ``shard`` (a shard file name)."""
    return f"part-{key}-{shard.removesuffix('.safetensors')}.safetensors"


def part_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A part file: safetensors laid out as shards are
    (:func:`~metastore_plugins.core.store.shards.shardfile.tensor_layout`), its metadata keys
    sorted; unlike the safetensors library's own writer (whose metadata order varies from call to call),
    deterministic."""
    specs = {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()}
    ranges, size = tensor_layout(specs)
    section = bytearray(size)
    for key, (begin, end) in ranges.items():
        section[begin:end] = np.ascontiguousarray(tensors[key].numpy()).view(np.uint8).reshape(-1).data
    return header_bytes(ranges, specs, dict(sorted(metadata.items()))) + bytes(section)


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    text = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode("ascii")
    return text + f" {zlib.crc32(text):08x}\n".encode()


def decode_manifest(data: bytes) -> dict[str, Any]:
    """The manifest of a file's bytes; :class:`StoreError` (one line) when it is torn, damaged or foreign, or any
    field is not of its kind and range (:func:`manifest_problem`). Bounded: a body of more objects or lists than its
    size holds parts (:data:`MIN_OBJECT_BYTES` each), or of more values than parts and layers make, is refused
    before it is parsed (100 million ``{}`` would take gigabytes as Python objects)."""
    body, _, tail = data.rstrip(b"\n").rpartition(b" ")
    if not data.endswith(b"\n") or not re.fullmatch(rb"[0-9a-f]{8}", tail) or zlib.crc32(body) != int(tail, 16):
        raise StoreError("its CRC-32 does not match (a damaged or torn file)")
    containers = (body.count(b"{") + body.count(b"[")) * MIN_OBJECT_BYTES
    if containers > len(body) + 8 * MIN_OBJECT_BYTES or body.count(b",") > len(body) // 16 + MAX_LAYERS + 64:
        raise StoreError("it holds more values than its size has room for (not an index manifest)")
    try:
        manifest = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise StoreError("it is not JSON") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise StoreError(f"it is not a version {VERSION} {FORMAT} manifest")
    problem = manifest_problem(manifest)
    if problem is not None:
        raise StoreError(problem)
    return manifest


#: The fewest bytes a part's entry takes in a manifest (two sha256 and two names: about 250 in practice).
MIN_OBJECT_BYTES = 128
#: Bounds of a manifest's numbers: a sketch ``dim`` and layer count (a row is ``layers x dim^2`` float32), rows.
MAX_DIM, MAX_LAYERS, MAX_ROWS = 1 << 10, 1 << 14, 1 << 40
SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)


def _count(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is an ``int`` (not a bool, a float or a string) in ``low..high``."""
    return type(value) is int and low <= value <= high


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """Why a decoded manifest's fields are not of their kinds and ranges (one line), or None."""
    layers, dim = manifest.get("layers"), manifest.get("dim")
    if not isinstance(manifest.get("capture_point"), str) or type(manifest.get("seed")) is not int:
        return "its capture_point or seed is not a string and an integer"
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_LAYERS or not all(isinstance(n, str) for n in layers):
        return f"its layers are not a list of 1 to {MAX_LAYERS} names"
    if not _count(dim, 1, MAX_DIM) or "shards" in manifest and not isinstance(manifest["shards"], str):
        return f"its dim is not an integer in 1..{MAX_DIM} (or its shards not a string)"
    if not isinstance(manifest.get("parts"), list) or not all(isinstance(p, dict) for p in manifest["parts"]):
        return "its parts are not a list of objects"
    for part in manifest["parts"]:
        named = all(isinstance(part.get(k), str) for k in ("file", "shard"))
        signed = all(isinstance(part.get(k), str) and SHA256.fullmatch(part[k]) for k in ("sha256", "shard_sha256"))
        if not (named and signed and OWN_NAME.fullmatch(part["file"]) and _count(part.get("rows"), 0, MAX_ROWS)):
            return "a part is not listed with its file, shard, both sha256 and a row count"
    ann = manifest.get("ann")
    return None if ann is None else ann_problem(ann, len(layers) * manifest["dim"] ** 2)


def ann_problem(ann: Any, width: int) -> str | None:
    """Why a manifest's ``ann`` entry (its search structure over rows ``width`` wide) is not one a reader can
    search within bounded work, or None: ``ivf`` with ``1 <= nprobe <= nlist <= 65536``, ``reduced`` with
    ``1 <= reduced <= width`` directions and ``1 <= candidates <= 65536``."""
    if not isinstance(ann, dict) or not all(isinstance(ann.get(k), str) for k in ("file", "sha256", "parts")):
        return "its search structure is not listed with its file and sha256"
    if not OWN_NAME.fullmatch(ann["file"]) or not _count(ann.get("rows"), 0, MAX_ROWS):
        return "its search structure's file or row count is not an index's"
    if ann.get("kind") == "ivf":
        nlist, nprobe = ann.get("nlist"), ann.get("nprobe")
        if _count(nlist, 1, 1 << 16) and _count(nprobe, 1, ann["nlist"]):
            return None
        return "its ivf search structure's nlist and nprobe are not 1 <= nprobe <= nlist <= 65536"
    if ann.get("kind") == "reduced":
        if _count(ann.get("reduced"), 1, width) and _count(ann.get("candidates"), 1, 1 << 16):
            return None
        return f"its reduced search structure's directions are not in 1..{width} or its candidates in 1..65536"
    return f"its search structure's kind {str(ann.get('kind'))[:40]!r} is not ivf or reduced"


#: The first four bytes of the FAISS file of each kind of search structure (``IndexIVFFlat``, ``IndexPreTransform``).
ANN_FOURCC = {"ivf": b"IwFl", "reduced": b"IxPT"}


def ann_cap(rows: int, width: int) -> int:
    """The largest FAISS file a reader accepts for ``rows`` rows ``width`` wide (IVF holds them whole, plus ids)."""
    return rows * (4 * (width + 1) + 64) + (64 << 20)


def ann_bytes_problem(data: bytes, ann: dict[str, Any], width: int) -> str | None:
    """Why a FAISS file's bytes (sound: their sha256 checked) are not the search structure ``ann`` describes, or
    None: its kind (FAISS's four bytes), width and row count (its header) and the bytes its rows take at least,
    read before FAISS is given the file (which allocates what a damaged header asks for)."""
    kind = ann["kind"]
    if data[:4] != ANN_FOURCC[kind] or len(data) < 16:
        return f"it is not a FAISS {kind} index"
    d, total = int.from_bytes(data[4:8], "little", signed=True), int.from_bytes(data[8:16], "little", signed=True)
    wanted = width + 1 if kind == "ivf" else width
    if (d, total) != (wanted, ann["rows"]):
        return f"it holds {total} rows {d} wide, not the {ann['rows']} rows {wanted} wide its manifest lists"
    # IVF: every row and its id; reduced: every row's reduced numbers and the (reduced, width) projection
    least = total * (4 * d + 8) if kind == "ivf" else (total + width) * 4 * ann["reduced"]
    return None if len(data) >= least else f"it is {len(data)} bytes, shorter than its rows (cut short)"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parts_digest(parts: list[dict[str, Any]]) -> str:
    """sha256 of the parts' ``(file, sha256)`` in order: what an ``ann`` file was built over."""
    return sha256(json.dumps([[p.get("file"), p.get("sha256")] for p in parts]).encode())


def read(store_dir: Path, name: str, cap: int, what: str) -> bytes:
    """The bytes of ``vector_index/name``; :class:`StoreError` when missing, a link, not regular or above ``cap``."""
    with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
        return folder.read(name, cap, what)


def read_checked(store_dir: Path, name: str, expected_sha256: str, cap: int, what: str) -> bytes:
    """:func:`read`, refused (:class:`StoreError`, one line) unless the bytes hash to ``expected_sha256``."""
    data = read(store_dir, name, cap, what)
    if sha256(data) != expected_sha256:
        raise StoreError(f"{store_dir / FOLDER / name}: {what} does not match the sha256 its manifest records")
    return data


def write(store_dir: Path, name: str, data: bytes) -> None:
    """Replace ``vector_index/name`` atomically (the folder created); OSError/StoreError when it cannot be."""
    with StoreDir(store_dir) as store, store.subdir(FOLDER, create=True) as folder:
        folder.atomic_write(name, data)


def identities(store_dir: Path, names: list[str]) -> tuple[tuple[int, int, int, int, int], ...] | None:
    """``(device, inode, size, mtime_ns, ctime_ns)`` of each ``vector_index/`` file (not followed), None if one is
    missing or not a regular file: a file replaced or rewritten since has another (its ctime, which the kernel sets
    on every write and no ``utime`` sets back, even when its mtime was set back by hand)."""
    try:
        with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
            found = [folder.lstat(name) for name in names]
    except (OSError, StoreError):
        return None
    if any(f is None or not stat.S_ISREG(f.st_mode) for f in found):
        return None
    return tuple((f.st_dev, f.st_ino, f.st_size, f.st_mtime_ns, f.st_ctime_ns) for f in found if f is not None)


def remove_temporaries(store_dir: Path, key: str | None = None) -> list[str]:
    """Remove the temporaries a build killed mid-write left in ``vector_index/`` (the files they would have
    replaced stay as they were), only those of index ``key``'s files where given; returns their names. A
    concurrent build whose temporary goes keeps its index in memory (ranks building their own indexes at once
    pass their ``key``)."""
    removed = []
    try:
        with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
            for name in folder.listdir():
                target = temporary_target(name)
                if target is None or (key is not None and f"-{key}" not in target) or folder.kind(name) != "file":
                    continue
                folder.remove(name, missing_ok=True)
                removed.append(name)
    except (OSError, StoreError):
        pass
    return removed


def read_manifest(store_dir: Path, key: str) -> dict[str, Any] | None:
    """The manifest of ``key``, ``None`` when there is none; :class:`StoreError` when it is damaged or a link."""
    try:
        data = read(store_dir, manifest_name(key), MAX_MANIFEST_BYTES, "vector index manifest")
    except StoreError as exc:
        if "missing on disk" in str(exc) or "no such directory" in str(exc):
            return None
        raise
    try:
        return decode_manifest(data)
    except StoreError as exc:
        raise StoreError(f"{store_dir / FOLDER / manifest_name(key)}: {exc}") from None


LOCK_NAME = "manifests.lock"
_LOCAL = threading.Lock()  # a POSIX record lock does not exclude the threads of one process


@contextmanager
def manifest_lock(store_dir: Path) -> Iterator[None]:
    """Hold ``vector_index/manifests.lock`` (waiting for it): what the write side changes a manifest under."""
    with _LOCAL, StoreDir(store_dir) as store, store.subdir(FOLDER, create=True) as folder:
        fd = folder.open_lock(LOCK_NAME)
        try:
            try:
                import fcntl
            except ImportError:  # pragma: no cover - Windows: the in-process lock only
                fcntl = None  # type: ignore[assignment]
            if fcntl is not None:
                fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the POSIX lock


def add_parts(store_dir: Path, key: str, head: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """List ``entries`` (written part files) in the manifest of ``key``, under :func:`manifest_lock`.

    A listed part of the same shard is replaced, and the search structure (built over other parts) is
    delisted: the next query builds it. A missing, damaged or
    foreign manifest is started anew from ``head``. Returns the files delisted (for the caller to remove).
    """
    gone = {str(e["shard"]) for e in entries}
    with manifest_lock(store_dir):
        try:
            manifest = read_manifest(store_dir, key)
        except StoreError:
            manifest = None
        if manifest is None or {k: manifest.get(k) for k in head} != head:
            manifest = {**head, "parts": [], "ann": None}
        kept = [p for p in manifest["parts"] if str(p.get("shard")) not in gone]
        delisted = [str(p.get("file")) for p in manifest["parts"] if str(p.get("shard")) in gone]
        ann = manifest.get("ann")
        delisted += [str(ann.get("file"))] if isinstance(ann, dict) else []
        write(store_dir, manifest_name(key), encode_manifest({**manifest, "parts": kept + entries, "ann": None}))
    listed = {str(e["file"]) for e in entries}
    return [name for name in delisted if name not in listed]


def manifest_keys(store_dir: Path) -> list[str]:
    """The keys of the manifests in ``vector_index/`` (none when it is missing or not a directory)."""
    try:
        with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
            names = folder.listdir()
    except (OSError, StoreError):
        return []
    return sorted(n[len("manifest-") : -len(".json")] for n in names if MANIFEST_NAME.fullmatch(n))


def remove(store_dir: Path, names: Iterable[str]) -> None:
    """Remove these ``vector_index/`` files where they are (never through a link)."""
    with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
        for name in names:
            if OWN_NAME.fullmatch(name) and folder.kind(name) in ("file", "link"):
                folder.remove(name, missing_ok=True)


def part_binding_problem(meta: Any, entry: dict[str, Any]) -> str | None:
    """Why a part (sound: its sha256 checked) is not the part of the shard its entry names, or None. ``meta``: its
    safetensors metadata, which records its shard's name and sha256: a manifest (CRC intact) that lists another
    shard's part under this shard's name is caught here, not by the sha256 (its rows are checked against the
    shard's own by the reader: :func:`~metastore_plugins.core.store.vectors.vector_check.rows_problem`)."""
    if not isinstance(meta, dict) or (meta.get("shard"), meta.get("shard_sha256")) != (
        entry.get("shard"),
        entry.get("shard_sha256"),
    ):
        return f"it is not the part of {entry.get('shard')} (its own metadata names another shard)"
    return None


#: The names of the index's own files (and their temporaries): repair removes no other file of the folder.
OWN_NAME = re.compile(r"(?:manifest-[0-9a-f]{16}\.json|part-[0-9a-f]{16}-.+\.safetensors|ann-[0-9a-f]{16}\.faiss)")
