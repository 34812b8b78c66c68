"""Reading one shard file safely: a regular file of the store, read whole, checked, parsed by hand.

A shard is opened without following links or blocking (FIFOs, devices), read into memory
(never memory-mapped: a file truncated under a mapping kills the process), checked against
what the index says (size, the checksums it lists over exactly the bytes read, the exact set of
tensor keys), and its safetensors header is parsed here within a size bound derived from those
keys, so a hostile header cannot cost more than the index allows. The header's entries are
checked as whole columns (numpy), and tensors are views of the one buffer read, never copies.

Checksums (:data:`DIGESTS`): ``sha256`` of the whole file (every store), and ``xxh3_128`` in
journal lines written since issue 35: 20 times faster here, so the query path checks it alone
where a line lists it; ``verify``, repair and compaction check both.
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
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import Tensor

from metastore_plugins.core.store.file_kinds import not_regular, os_problem
from metastore_plugins.core.store.files import StoreDir, StoreError, open_regular

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
    """What the index says of a shard: its size, checksums (None: not checked) and tensor keys.

    Every checksum given is checked; :meth:`~metastore_plugins.core.store.index.StoreIndex.expectation`
    gives ``sha256`` None on the query path where the line lists ``xxh3_128``.
    """

    bytes: int
    sha256: str | None
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    xxh3_128: str | None = None

    def digests(self) -> dict[str, str]:
        """``{checksum name: lowercase hex}`` of the checksums to check."""
        found = {"sha256": self.sha256, "xxh3_128": self.xxh3_128}
        return {name: value for name, value in found.items() if value is not None}


def _xxh3_128(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _sha256(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


#: Checksum name -> hex digest of a buffer (the journal field of the same name).
DIGESTS: dict[str, Callable[[Any], str]] = {"xxh3_128": _xxh3_128, "sha256": _sha256}


def digests_of(*parts: Any) -> dict[str, str]:
    """Every checksum (:data:`DIGESTS`) of the bytes the buffers ``parts`` make together."""
    sha256, fast = hashlib.sha256(), xxhash.xxh3_128()
    for part in parts:
        sha256.update(part)
        fast.update(part)
    return {"sha256": sha256.hexdigest(), "xxh3_128": fast.hexdigest()}


def check_digests(path: Path, data: Any, wanted: dict[str, str]) -> None:
    """Check ``data`` (the whole file) against each ``{name: hex}``; :class:`StoreError` at the first mismatch."""
    for name in sorted(wanted, key=["sha256", "xxh3_128"].index):  # sha256 first where it is asked for (verify)
        actual = DIGESTS[name](data)
        if actual != wanted[name]:
            raise StoreError(
                f"{path}: checksum mismatch, {name} {actual} on disk but {wanted[name]} in the index "
                "(the file is damaged)"
            )


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
    """The checked bytes of one shard and its parsed header.

    Tensors (:meth:`get`) are views of the one buffer read, not copies: they are shared with every
    later read of the shard in this process (:mod:`~metastore_plugins.core.store.readcache`), so
    they are read-only by contract: copy one (``.clone()``) before changing it. A change made in
    place through torch is noticed (:meth:`intact` turns False) and the shard is then read from
    disk and checked again rather than served changed. ``bool`` tensors, and tensors whose offset
    is not a multiple of their element size (other writers than this one), are copies.

    Attributes:
        path: the file read. identity: its ``(st_dev, st_ino, st_size, st_mtime_ns)`` when read.
        metadata: the header's ``__metadata__`` map. expected: the ``(required, optional)`` keys checked.
    """

    def __init__(
        self,
        path: Path,
        buffer: Tensor,
        header: dict[str, Entry],
        start: int,
        identity: tuple[int, int, int, int],
        metadata: dict[str, str],
        expected: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
    ) -> None:
        self.path, self._buffer, self._header, self._start = path, buffer, header, start  # buffer: (nbytes,) uint8
        self.identity, self.metadata = identity, metadata
        self.expected = expected  # the (required, optional) keys the header was checked against
        self._version = buffer._version
        self._by_prefix: dict[str, list[str]] = {}
        for key in header:  # "b{j}/" and "b{j}/r{k}/" (or "b{j}/meta/")
            first = key.find("/")
            second = key.find("/", first + 1)
            self._by_prefix.setdefault(key[: first + 1], []).append(key)
            if second > 0:
                self._by_prefix.setdefault(key[: second + 1], []).append(key)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (the whole file)."""
        return int(self._buffer.numel())

    def intact(self) -> bool:
        """False once a tensor of this shard was changed in place (through torch): no longer the checked bytes."""
        return self._buffer._version == self._version

    def raw(self) -> Tensor:
        """``(nbytes,)`` uint8: the whole file's bytes (shared; read-only by contract)."""
        return self._buffer

    def buffer(self) -> memoryview:
        """The whole file's bytes (a read-only view; no copy)."""
        return self._buffer.numpy().data.toreadonly()

    def keys(self) -> list[str]:
        """Every tensor key, in header order."""
        return list(self._header)

    def stored(self, key: str) -> tuple[torch.dtype, tuple[int, ...], memoryview]:
        """A tensor's dtype, shape and bytes as stored (a view of the checked bytes; no copy)."""
        dtype, shape, (begin, end) = self._header[key]
        return dtype, shape, self.buffer()[self._start + begin : self._start + end]

    def keys_of_batch(self, batch: int) -> list[str]:
        """The keys of stored batch ``batch`` (those starting with ``b{batch}/``)."""
        return list(self._by_prefix.get(f"b{batch}/", ()))

    def get(self, key: str) -> Tensor:
        """The tensor ``key``: a read-only view of the checked bytes (see the class); :class:`StoreError`
        when the shard lacks it."""
        entry = self._header.get(key)
        if entry is None:
            raise StoreError(f"{self.path}: holds no tensor {ascii(key)}")
        dtype, shape, (begin, end) = entry
        if begin == end:
            return torch.zeros(shape, dtype=dtype)
        raw = self._buffer[self._start + begin : self._start + end]  # (nbytes,) uint8
        if dtype == torch.bool:
            return (raw != 0).view(shape)  # a copy: a bool byte other than 0 is True
        if (self._start + begin) % dtype.itemsize:
            raw = raw.clone()  # not aligned to its element size: viewed as a copy
        return raw.view(dtype).view(shape)

    def read(self, batch: int, prefix: str) -> dict[str, Tensor]:
        """The tensors of stored batch ``batch`` whose keys start with ``prefix``, keyed without it.

        ``prefix`` ``"b{batch}/r{k}/"`` or ``"b{batch}/meta/"`` is looked up directly."""
        keys = self._by_prefix.get(prefix)
        if keys is None:
            keys = [key for key in self.keys_of_batch(batch) if key.startswith(prefix)]
        return {key[len(prefix) :]: self.get(key) for key in keys}


def read_shard(path: Path, directory: Path, expect: ShardExpectation) -> ShardData:
    """Read and check a shard whole; :class:`StoreError` starting with the path when it is not sound."""
    fd, opened = open_regular(path, directory)
    try:
        return read_opened(fd, opened, path, expect)
    finally:
        os.close(fd)


def read_opened(fd: int, opened: os.stat_result, path: Path, expect: ShardExpectation) -> ShardData:
    """:func:`read_shard` of a file already opened (``fd``, its ``fstat`` ``opened``); the caller closes ``fd``."""
    if sys.byteorder != "little":
        raise NotImplementedError("shards are read on little-endian hosts only (safetensors stores little-endian)")
    size_problem(path, opened, expect)
    buffer = torch.empty(expect.bytes, dtype=torch.uint8)  # (bytes,), filled by readinto: no zeroing pass
    view, done = buffer.numpy().data, 0
    try:
        with io.FileIO(fd, "rb", closefd=False) as handle:
            while done < expect.bytes:
                got = handle.readinto(view[done:])
                if not got:
                    raise StoreError(f"{path}: shrank while it was read (truncated or rewritten)")
                done += got
            if handle.read(1):
                raise StoreError(f"{path}: grew while it was read (rewritten)")
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    check_digests(path, view, expect.digests())
    view.release()
    identity = (opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns)
    return parse_shard(path, buffer, expect, identity)


def size_problem(path: Path, opened: os.stat_result, expect: ShardExpectation) -> None:
    """:class:`StoreError` when the file's size is not the one the index lists."""
    if opened.st_size != expect.bytes:
        raise StoreError(
            f"{path}: size mismatch, {opened.st_size} bytes on disk but {expect.bytes} in the index "
            "(truncated or rewritten)"
        )


def parse_shard(path: Path, buffer: Tensor, expect: ShardExpectation, identity: tuple[int, int, int, int]) -> ShardData:
    """The :class:`ShardData` of checked bytes ``buffer`` (``(bytes,)`` uint8): its header parsed and checked."""
    header, metadata, start = _parse_header(path, buffer.numpy().data, expect)
    return ShardData(path, buffer, header, start, identity, metadata, (expect.required, expect.optional))


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
    path: Path, data: memoryview, expect: ShardExpectation
) -> tuple[dict[str, Entry], dict[str, str], int]:
    def fail(what: str) -> StoreError:
        return StoreError(f"{path}: not a readable safetensors file ({what})")

    if len(data) < 8:
        raise fail("shorter than its 8-byte header length")
    length, cap = int.from_bytes(data[:8], "little"), header_cap(expect)
    if length > len(data) - 8 or length > cap:
        raise fail(f"a header of {length} bytes, larger than the file or the {cap} bytes its index allows")
    try:
        text = str(data[8 : 8 + length], "utf-8")
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
    header = _entries(raw, size)
    if header is None:  # something is wrong: the first entry at fault, by name
        header = {key: _entry(key, entry, size, fail) for key, entry in raw.items()}
    keys = list(header)
    spans = np.array([span for _, _, span in header.values()], dtype=np.int64).reshape(-1, 2)  # (n, 2)
    used = np.flatnonzero(spans[:, 0] != spans[:, 1])
    order = used[np.argsort(spans[used, 0], kind="stable")]  # non-empty tensors by offset
    clash = np.flatnonzero(spans[order[1:], 0] < spans[order[:-1], 1])
    if len(clash):
        first, second = order[clash[0]], order[clash[0] + 1]
        raise fail(f"tensors {keys[first]} and {keys[second]} overlap")
    return header, metadata, start


def _entries(raw: dict[str, Any], size: int) -> dict[str, Entry] | None:
    """Every entry checked as columns (dtype, shape, offsets); None when one is wrong (:func:`_entry` names it)."""
    try:
        values = list(raw.values())
        names = [value["dtype"] for value in values]
        shapes = [value["shape"] for value in values]
        offsets = [value["data_offsets"] for value in values]
        dtypes = [_DTYPES[name] for name in names]
    except (TypeError, KeyError):  # not a dict, a field missing, an unknown or unhashable dtype
        return None
    if not (
        all(type(shape) is list and len(shape) <= _MAX_DIMS for shape in shapes)
        and all(type(pair) is list and len(pair) == 2 for pair in offsets)
    ):
        return None
    dims = list(chain.from_iterable(shapes))
    bounds = list(chain.from_iterable(offsets))
    if not all(type(value) is int for value in chain(dims, bounds)):
        return None  # floats, bools, None, strings
    try:
        dim_array = np.array(dims, dtype=np.int64)  # (sum of ranks,)
        span = np.array(bounds, dtype=np.int64).reshape(-1, 2)  # (n, 2)
    except OverflowError:
        return None
    if (dim_array < 0).any() or (dim_array >= 2**40).any() or (span < 0).any() or (span >= 2**40).any():
        return None
    itemsize = np.array([dtype.itemsize for dtype in dtypes], dtype=np.int64)  # (n,)
    numel = [math.prod(shape) for shape in shapes]  # exact: up to 16 sizes below 2^40
    if not ((span[:, 0] <= span[:, 1]).all() and (span[:, 1] <= size).all()):
        return None
    if not all(n * i == e for n, i, e in zip(numel, itemsize.tolist(), (span[:, 1] - span[:, 0]).tolist())):
        return None
    return {
        key: (dtype, tuple(shape), (begin, end))
        for key, dtype, shape, (begin, end) in zip(raw, dtypes, shapes, span.tolist())
    }


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
