"""Reading one shard file safely: a regular file of the store, read whole, checked, parsed by hand.

A shard is opened without following links or blocking (FIFOs, devices), read into memory
(never memory-mapped: a file truncated under a mapping kills the process), checked against
what the index says (size, sha256 of exactly the bytes read, the exact set of tensor keys),
and its safetensors header is parsed here within a size bound derived from those keys, so a
hostile header cannot cost more than the index allows. Tensors are copies of the checked bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from metastore_plugins.core.store.files import StoreDir, StoreError, not_regular, open_regular, os_problem

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SCALED_ENCODINGS = ("fp16", "int8")  # as encoding.stored_specs: every floating tensor, zero rows included
_FLOAT_TENSORS = ("prefix", "suffix", "projected")  # encoded: with row scales under fp16 / int8
_KIND_TENSORS = {
    "outer": ("prefix", "suffix", "sample", "position"),
    "embedding": ("ids", "suffix", "sample", "position"),
    "projected": ("projected", "sq_norm"),
    "norms": ("sq_norm",),
}
#: Header bytes allowed per expected key (beyond 6 per byte of its name: JSON escapes), and for
#: ``__metadata__`` and padding. A real entry of 9 dimensions takes under 200 bytes plus its name.
_HEADER_BYTES_PER_KEY = 256
_HEADER_SLACK = 1 << 16
_MAX_DIMS = 16


def file_problem(path: Path, directory: Path) -> str | None:
    """What keeps ``path`` from being read as a regular file of ``directory`` (it is not opened), or None."""
    if path.parent != directory:
        return f"is not a file of the store directory {directory}; not read"
    try:
        with StoreDir(directory) as opened:
            found = opened.lstat(path.name)
    except (OSError, StoreError) as exc:
        return os_problem(exc) if isinstance(exc, OSError) else str(exc)
    return "missing on disk" if found is None else not_regular(found.st_mode)


@dataclass(frozen=True)
class ShardExpectation:
    """What the index says of a shard: its size, sha256 (None: not checked) and tensor keys."""

    bytes: int
    sha256: str | None
    required: frozenset[str]
    optional: frozenset[str] = frozenset()


#: One stored batch: its metadata columns (None: not recorded, version 1) and its records' ``(kind, roles)``.
BatchKeys = tuple[Collection[str] | None, Sequence[tuple[str, Sequence[str]]]]


def expected_keys(batches: Sequence[BatchKeys], encoding: str) -> tuple[frozenset[str], frozenset[str]]:
    """``(required, optional)`` tensor keys of a shard from its batches' ``(meta columns, [(kind, roles)])``.

    ``meta columns`` None (version 1: not recorded) makes label, loss and prediction optional
    (``margin`` came after version 1: a version 1 shard never holds it, so it stays unexpected there).
    With ``fp16`` and ``int8`` every floating tensor has its ``.scale`` key.
    """
    scaled = encoding in _SCALED_ENCODINGS
    required: set[str] = set()
    optional: set[str] = set()
    for j, (meta, records) in enumerate(batches):
        required.add(f"b{j}/meta/sample_id")
        if meta is None:
            optional.update(f"b{j}/meta/{column}" for column in ("label", "loss", "prediction"))
        else:
            required.update(f"b{j}/meta/{column}" for column in meta)
        for k, (kind, roles) in enumerate(records):
            names = [f"grad.{role}" for role in roles] if kind == "dense" else list(_KIND_TENSORS[kind])
            floats = names if kind == "dense" else [n for n in names if n in _FLOAT_TENSORS]
            required.update(f"b{j}/r{k}/{name}" for name in names)
            if scaled:
                required.update(f"b{j}/r{k}/{name}.scale" for name in floats)
    return frozenset(required), frozenset(optional)


Entry = tuple[torch.dtype, tuple[int, ...], tuple[int, int]]


class ShardData:
    """The checked bytes of one shard and its parsed header; tensors are copies.

    Attributes:
        path: the file read. identity: its ``(st_dev, st_ino, st_size, st_mtime_ns)`` when read.
        metadata: the header's ``__metadata__`` map.
    """

    def __init__(
        self,
        path: Path,
        data: bytearray,
        header: dict[str, Entry],
        start: int,
        identity: tuple[int, int, int, int],
        metadata: dict[str, str],
    ) -> None:
        self.path, self._data, self._header, self._start = path, data, header, start
        self.identity, self.metadata = identity, metadata
        self._by_batch: dict[str, list[str]] = {}
        for key in header:
            self._by_batch.setdefault(key.split("/", 1)[0], []).append(key)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (the whole file)."""
        return len(self._data)

    def keys(self) -> list[str]:
        """Every tensor key, in header order."""
        return list(self._header)

    def stored(self, key: str) -> tuple[torch.dtype, tuple[int, ...], memoryview]:
        """A tensor's dtype, shape and bytes as stored (a view of the checked bytes; no copy)."""
        dtype, shape, (begin, end) = self._header[key]
        return dtype, shape, memoryview(self._data)[self._start + begin : self._start + end]

    def keys_of_batch(self, batch: int) -> list[str]:
        """The keys of stored batch ``batch`` (those starting with ``b{batch}/``)."""
        return list(self._by_batch.get(f"b{batch}", ()))

    def get(self, key: str) -> Tensor:
        """The tensor ``key`` (an independent copy); :class:`StoreError` when the shard lacks it."""
        entry = self._header.get(key)
        if entry is None:
            raise StoreError(f"{self.path}: holds no tensor {ascii(key)}")
        dtype, shape, (begin, end) = entry
        if begin == end:
            return torch.zeros(shape, dtype=dtype)
        view = torch.frombuffer(
            self._data, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=self._start + begin
        )
        return view.clone().reshape(shape)  # the copy stores a bool byte other than 0 as 1

    def read(self, batch: int, prefix: str) -> dict[str, Tensor]:
        """The tensors of stored batch ``batch`` whose keys start with ``prefix``, keyed without it."""
        return {key[len(prefix) :]: self.get(key) for key in self.keys_of_batch(batch) if key.startswith(prefix)}


def read_shard(path: Path, directory: Path, expect: ShardExpectation) -> ShardData:
    """Read and check a shard whole; :class:`StoreError` starting with the path when it is not sound."""
    if sys.byteorder != "little":
        raise NotImplementedError("shards are read on little-endian hosts only (safetensors stores little-endian)")
    fd, opened = open_regular(path, directory)
    try:
        if opened.st_size != expect.bytes:
            raise StoreError(
                f"{path}: size mismatch, {opened.st_size} bytes on disk but {expect.bytes} in the index "
                "(truncated or rewritten)"
            )
        data = bytearray(expect.bytes)
        view, done = memoryview(data), 0
        with io.FileIO(fd, "rb", closefd=False) as handle:
            while done < expect.bytes:
                got = handle.readinto(view[done:])
                if not got:
                    raise StoreError(f"{path}: shrank while it was read (truncated or rewritten)")
                done += got
            if handle.read(1):
                raise StoreError(f"{path}: grew while it was read (rewritten)")
        view.release()
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if expect.sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expect.sha256:
            raise StoreError(
                f"{path}: checksum mismatch, sha256 {actual} on disk but {expect.sha256} in the index "
                "(the file is damaged)"
            )
    header, metadata, start = _parse_header(path, data, expect)
    identity = (opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns)
    return ShardData(path, data, header, start, identity, metadata)


def header_cap(expect: ShardExpectation) -> int:
    """The largest safetensors header (bytes) a shard with the expected keys may have."""
    keys = expect.required | expect.optional
    return _HEADER_SLACK + sum(_HEADER_BYTES_PER_KEY + 6 * len(key.encode()) for key in keys)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice in one object")
    return out


def _parse_header(
    path: Path, data: bytearray, expect: ShardExpectation
) -> tuple[dict[str, Entry], dict[str, str], int]:
    def fail(what: str) -> StoreError:
        return StoreError(f"{path}: not a readable safetensors file ({what})")

    if len(data) < 8:
        raise fail("shorter than its 8-byte header length")
    length, cap = int.from_bytes(data[:8], "little"), header_cap(expect)
    if length > len(data) - 8 or length > cap:
        raise fail(f"a header of {length} bytes, larger than the file or the {cap} bytes its index allows")
    try:
        text = bytes(data[8 : 8 + length]).decode("utf-8")
        raw = json.loads(text)
        if isinstance(raw, dict) and text.count('"data_offsets"') != len(raw) - ("__metadata__" in raw):
            raw = json.loads(text, object_pairs_hook=_unique)  # a key twice? (the hook costs a third of the parse)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(f"header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise fail("header is not a JSON object")
    metadata = raw.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise fail("__metadata__ is not a map of strings")
    unexpected = sorted(set(raw) - expect.required - expect.optional)
    if unexpected:
        raise StoreError(f"{path}: holds {len(unexpected)} tensor key(s) the index does not list: {_few(unexpected)}")
    missing = sorted(expect.required - set(raw))
    if missing:
        raise StoreError(f"{path}: lacks {len(missing)} tensor key(s) the index lists: {_few(missing)}")
    start, size = 8 + length, len(data) - 8 - length
    header = {key: _entry(key, entry, size, fail) for key, entry in raw.items()}
    spans = sorted((span, key) for key, (_, _, span) in header.items() if span[0] != span[1])
    for (first, key), (second, other) in zip(spans, spans[1:]):
        if second[0] < first[1]:
            raise fail(f"tensors {key} and {other} overlap")
    return header, metadata, start


def _entry(key: str, entry: Any, size: int, fail: Callable[[str], StoreError]) -> Entry:
    dtype_name = entry.get("dtype") if isinstance(entry, dict) else None
    if not (isinstance(dtype_name, str) and dtype_name in _DTYPES):
        raise fail(f"tensor {key} has dtype {ascii(dtype_name)[:40]}, not one of {', '.join(_DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_small_int(d) for d in shape)):
        raise fail(f"tensor {key} has no valid shape (a list of at most {_MAX_DIMS} sizes below 2^40)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_small_int(v) for v in offsets)):
        raise fail(f"tensor {key} has no valid data_offsets (two byte offsets)")
    dtype = _DTYPES[dtype_name]
    begin, end = offsets
    if not begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
        raise fail(f"tensor {key} has data_offsets {offsets} that do not fit its shape {shape} in {size} data bytes")
    return dtype, tuple(shape), (begin, end)


def _small_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40


def _few(keys: list[str]) -> str:
    return ", ".join(ascii(k)[1:-1] for k in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def shard_problem(path: Path, directory: Path, expect: ShardExpectation) -> str | None:
    """What :func:`read_shard` would refuse, without the leading path, or None when the shard is sound."""
    try:
        read_shard(path, directory, expect)
    except StoreError as exc:
        text = str(exc)
        return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text
    return None
