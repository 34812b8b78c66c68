"""Tags kept as columns: ``<store>/tag_cache/tags-rank{r}.safetensors``, derived from ``tags-rank{r}.jsonl``.

Parsing a million tag lines costs about 10 s; a query over them (``GradientStore.find``) reads these columns
instead and parses only the lines appended since. One file per tags file holds numpy arrays, one row per tag in
the order written:

- ``first_step``, ``last_step``, ``rank``, ``seq``: ``(T,)`` int64; ``automatic``: ``(T,)`` uint8;
- ``name``, ``capture_point`` (-1: all), ``keep`` (index into ``KEEP_CHOICES``, -1: None): ``(T,)`` int32 into
  tables (``names`` and ``capture_points`` in the metadata, JSON lists);
- ``attributes``: ``(T,)`` int32 into the distinct attribute objects, whose JSON texts are ``attribute_text``
  (uint8, joined) cut at ``attribute_end`` (``(U,)`` int64): parsed only for the rows a query returns or filters.

Its metadata says what it was built from. A reader uses it only when all hold: ``format`` and ``version`` are
this module's; ``source`` is the tags file's name; the tags file read now is at least ``upto`` bytes long and its
first ``upto`` bytes hash (xxh3-128) to ``digest`` (so a tags file rewritten anywhere in that part, whatever its
size, mtime or CRCs say, is parsed again); the arrays have the dtypes and shapes above, index within their
tables, and their bytes hash to ``checksum``. Anything else (missing, damaged, foreign, a link, a FIFO) is
ignored unread and rebuilt. Files are read within a cap from the tags file's size and written through
:meth:`~metastore_plugins.core.store.files.StoreDir.atomic_write`; a store that cannot be written (read-only, a
linked ``tag_cache/``) is answered from the parse, without error. ``verify --repair`` removes a damaged file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors import SafetensorError
from safetensors.numpy import load as load_bytes
from safetensors.numpy import save as save_bytes

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import KEEP_CHOICES
from metastore_plugins.core.store.file_kinds import any_temporary_target
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.tags.book import MAX_TAGS_BYTES, parse_from, read_file, tag_files
from metastore_plugins.core.store.tags.tag_line import Tag

#: The folder of the cache inside a store directory.
FOLDER = "tag_cache"
FORMAT, VERSION = "metastore-tag-cache", "1"
#: Bytes a cache file may hold beyond twice the tags file's size (its columns, header, tables): refused unread.
MAX_EXTRA_BYTES = 1 << 20
_INTS = ("first_step", "last_step", "rank", "seq")
_INDICES = ("name", "capture_point", "keep", "attributes")
_DTYPES = {**dict.fromkeys(_INTS, np.int64), **dict.fromkeys(_INDICES, np.int32), "automatic": np.uint8}


@dataclass(frozen=True)
class TagColumns:
    """The tags of one file as columns (module docstring); ``upto``: the bytes of the tags file they hold."""

    arrays: dict[str, np.ndarray]  # each (T,), see _DTYPES; and attribute_text (bytes,), attribute_end (U,)
    names: list[str]
    capture_points: list[str]
    upto: int

    def __len__(self) -> int:
        return len(self.arrays["seq"])

    def attributes(self, which: np.ndarray) -> list[dict[str, Any]]:
        """The attribute objects ``which`` (indices into the distinct ones), parsed in one ``json.loads``."""
        text, end = self.arrays["attribute_text"].tobytes(), self.arrays["attribute_end"]
        start = np.concatenate([[0], end[:-1]])
        picked = [text[s:e] for s, e in zip(start[which].tolist(), end[which].tolist())]
        return list(json.loads(b"[" + b",".join(picked) + b"]")) if picked else []


def columns_of(tags: list[Tag], upto: int) -> TagColumns:
    """The columns of ``tags`` parsed from ``upto`` bytes."""
    names: dict[str, int] = {}
    points: dict[str, int] = {}
    texts: dict[str, int] = {}
    keeps: dict[str | None, int] = {keep: i for i, keep in enumerate(KEEP_CHOICES)}
    encode = json.JSONEncoder(separators=(",", ":")).encode  # keys in the order written
    arrays: dict[str, np.ndarray] = {
        key: np.fromiter((getattr(t, key) for t in tags), np.int64, len(tags)) for key in _INTS
    }
    arrays["automatic"] = np.fromiter((t.automatic for t in tags), np.uint8, len(tags))
    arrays["name"] = np.fromiter((names.setdefault(t.name, len(names)) for t in tags), np.int32, len(tags))
    arrays["capture_point"] = np.fromiter(
        (-1 if t.capture_point is None else points.setdefault(t.capture_point, len(points)) for t in tags),
        np.int32,
        len(tags),
    )
    arrays["keep"] = np.fromiter((keeps.get(t.keep, -1) for t in tags), np.int32, len(tags))
    arrays["attributes"] = np.fromiter(
        (texts.setdefault(encode(t.attributes), len(texts)) for t in tags), np.int32, len(tags)
    )
    encoded = [text.encode() for text in texts]
    arrays["attribute_text"] = np.frombuffer(b"".join(encoded), np.uint8).copy()
    arrays["attribute_end"] = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), dtype=np.int64)
    return TagColumns(arrays, list(names), list(points), upto)


def joined(a: TagColumns, b: TagColumns) -> TagColumns:
    """The rows of ``a`` then ``b`` (``b`` parsed from the bytes after ``a``'s), their tables merged."""
    names = {n: i for i, n in enumerate(a.names)}
    points = {p: i for i, p in enumerate(a.capture_points)}
    to_name = np.array([names.setdefault(n, len(names)) for n in b.names], np.int32)  # (len(b.names),)
    to_point = np.array([points.setdefault(p, len(points)) for p in b.capture_points] + [-1], np.int32)  # -1: all
    more = dict(b.arrays)
    more["name"], more["capture_point"] = to_name[b.arrays["name"]], to_point[b.arrays["capture_point"]]
    more["attributes"] = b.arrays["attributes"] + np.int32(len(a.arrays["attribute_end"]))
    more["attribute_end"] = b.arrays["attribute_end"] + len(a.arrays["attribute_text"])
    arrays = {key: np.concatenate([a.arrays[key], more[key]]) for key in a.arrays}
    return TagColumns(arrays, list(names), list(points), b.upto)


def read_columns(root: StoreDir, tags_file: str) -> TagColumns:
    """The tags of ``tags_file`` as columns: the cache's where it holds a prefix of the file's bytes now, and the
    lines after that prefix parsed (every line when there is no usable cache); the cache rewritten when it grew.

    Raises:
        StoreError: as :func:`~metastore_plugins.core.store.tags.book.read_tags`.
    """
    data = root.read(tags_file, MAX_TAGS_BYTES, "a tags file")
    cached = load(root, tags_file, data)
    if cached is not None and cached.upto == len(data):
        return cached
    if cached is None:
        tags, good, _ = read_file(root, tags_file, data=data)
        columns = columns_of(tags, good)
    else:
        tags, good, _ = parse_from(root.path / tags_file, data, cached.upto, len(cached))
        columns = joined(cached, columns_of(tags, good)) if tags else cached
    if cached is None or columns.upto != cached.upto:
        save(root, tags_file, data, columns)
    return columns


def find_columns(store_dir: Path, tag: str | None, attributes: dict[str, Any]) -> dict[str, list[Any]]:
    """The tags of every rank named ``tag`` (any: None) whose attributes include ``attributes``, by rank then order
    written, as lists by field (``name``, ``first_step``, ``last_step``, ``keep``, ``capture_point``,
    ``automatic``, ``rank``, ``attributes``: one shared dict per distinct object; copy before handing out).

    Raises:
        StoreError: as :func:`~metastore_plugins.core.store.tags.book.read_tags`.
    """
    root, files = tag_files(store_dir)
    out: dict[str, list[Any]] = {key: [] for key in ("name", *_INTS[:2], "keep", "capture_point", "automatic",
                                                     "rank", "attributes")}  # fmt: skip
    if root is None:
        return out
    with root:
        for file in files:
            columns = read_columns(root, file)
            rows = np.arange(len(columns))  # (R,) the rows that match, in order written
            if tag is not None:
                named = columns.names.index(tag) if tag in columns.names else -1
                rows = np.flatnonzero(columns.arrays["name"] == named)
            which, back = np.unique(columns.arrays["attributes"][rows], return_inverse=True)  # (U,), (R,)
            parsed = columns.attributes(which)
            if attributes:
                fits = np.array([all(k in p and p[k] == v for k, v in attributes.items()) for p in parsed], bool)
                rows, back = rows[fits[back]], back[fits[back]]
            for key in _INTS[:2] + ("rank",):
                out[key] += columns.arrays[key][rows].tolist()
            out["automatic"] += columns.arrays["automatic"][rows].astype(bool).tolist()
            tables: dict[str, list[Any]] = {"name": columns.names, "capture_point": [*columns.capture_points, None],
                      "keep": [*KEEP_CHOICES, None]}  # fmt: skip  # index -1: None
            for key, table in tables.items():
                out[key] += [table[i] for i in columns.arrays[key][rows].tolist()]
            out["attributes"] += [parsed[i] for i in back.tolist()]
    return out


def cache_name(tags_file: str) -> str:
    return tags_file.removesuffix(".jsonl") + ".safetensors"


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    digest = xxhash.xxh3_128()
    for key in sorted(arrays):
        digest.update(key.encode())
        digest.update(np.ascontiguousarray(arrays[key]).tobytes())
    return digest.hexdigest()


def _parse(data: bytes) -> tuple[dict[str, str], dict[str, np.ndarray]] | None:
    """``(metadata, arrays)`` of a cache file's bytes whose arrays are whole and hash to its checksum, else None."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < size <= len(data) - 8:
        return None
    try:
        header = json.loads(data[8 : 8 + size])
        arrays = load_bytes(data)
    except (ValueError, RecursionError, SafetensorError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return None
    if set(arrays) != {*_DTYPES, "attribute_text", "attribute_end"} or meta.get("checksum") != _checksum(arrays):
        return None
    return meta, arrays


def _sound(meta: dict[str, str], arrays: dict[str, np.ndarray]) -> TagColumns | None:
    """The columns of a parsed cache file when every array has its dtype and shape and indexes within its table."""
    try:
        names, points, upto = json.loads(meta["names"]), json.loads(meta["capture_points"]), int(meta["upto"])
    except (KeyError, ValueError, RecursionError):
        return None
    if not (isinstance(names, list) and isinstance(points, list) and all(type(n) is str for n in names + points)):
        return None
    count, ends = len(arrays["seq"]), arrays["attribute_end"]
    shaped = all(arrays[k].dtype == d and arrays[k].shape == (count,) for k, d in _DTYPES.items())
    if not shaped or arrays["attribute_text"].dtype != np.uint8 or ends.dtype != np.int64 or ends.ndim != 1:
        return None
    bounds = {"name": len(names), "capture_point": len(points), "keep": len(KEEP_CHOICES), "attributes": len(ends)}
    low = {"name": 0, "capture_point": -1, "keep": -1, "attributes": 0}
    if count and any(arrays[k].min() < low[k] or arrays[k].max() >= n for k, n in bounds.items()):
        return None
    if len(ends) and (ends[-1] != len(arrays["attribute_text"]) or (np.diff(ends, prepend=0) <= 0).any()):
        return None
    return TagColumns(arrays, names, points, upto)


def load(root: StoreDir, tags_file: str, data: bytes) -> TagColumns | None:
    """The cached columns of ``tags_file`` when they were built from a prefix of ``data`` (its bytes now), else None."""
    cap = 2 * len(data) + MAX_EXTRA_BYTES  # columns: under 60 bytes a tag (a line: about 200)
    try:
        with root.subdir(FOLDER) as folder:
            parsed = _parse(folder.read(cache_name(tags_file), cap, "a tag cache file"))
    except (OSError, StoreError):  # missing or unusable: rebuilt by the caller
        return None
    if parsed is None or parsed[0].get("source") != tags_file:
        return None
    columns = _sound(*parsed)
    if columns is None or not 0 <= columns.upto <= len(data):
        return None
    if xxhash.xxh3_128_hexdigest(memoryview(data)[: columns.upto]) != parsed[0].get("digest"):
        return None
    return columns


def save(root: StoreDir, tags_file: str, data: bytes, columns: TagColumns) -> bool:
    """Write the cache file of ``tags_file`` (``columns`` parsed from ``data[:columns.upto]``) atomically; False
    (and no file) where the store cannot be written or ``tag_cache/`` is not the store's own."""
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "source": tags_file,
        "upto": str(columns.upto),
        "digest": xxhash.xxh3_128_hexdigest(memoryview(data)[: columns.upto]),
        "names": json.dumps(columns.names),
        "capture_points": json.dumps(columns.capture_points),
        "checksum": _checksum(columns.arrays),
    }
    try:
        with root.subdir(FOLDER, create=True) as folder:
            folder.atomic_write(cache_name(tags_file), save_bytes(columns.arrays, metadata=metadata))
    except (OSError, StoreError, SafetensorError):  # read-only store, full disk: answered from the parse
        return False
    return True


def repair(directory: Path) -> list[str]:
    """Remove the damaged files and leftover temporaries of ``tag_cache/`` (rebuilt by the next query); one line per
    file removed."""
    done = []
    try:
        with StoreDir(directory) as root:
            if root.kind(FOLDER) != "directory":
                return []
            with root.subdir(FOLDER) as folder:
                for name in sorted(folder.listdir()):
                    if folder.kind(name) != "file":
                        continue
                    if any_temporary_target(name) is not None:  # a writer stopped before its rename
                        folder.remove(name)
                        done.append(f"{folder.path / name}: leftover temporary of the tag cache removed")
                        continue
                    source = root.lstat(name.removesuffix(".safetensors") + ".jsonl")
                    limit = source.st_size if source is not None else MAX_TAGS_BYTES
                    try:
                        parsed = _parse(folder.read(name, 2 * limit + MAX_EXTRA_BYTES, "a tag cache file"))
                    except StoreError:
                        parsed = None
                    if parsed is None or _sound(*parsed) is None:
                        folder.remove(name)
                        done.append(f"{folder.path / name}: damaged tag cache removed (rebuilt by the next query)")
    except (OSError, StoreError):
        return done
    return done
