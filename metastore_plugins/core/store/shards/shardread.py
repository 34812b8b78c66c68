"""Reading one shard file safely: a regular file of the store, read whole, checked, parsed by hand.

A shard is opened without following links or blocking (FIFOs, devices), read into memory
(never memory-mapped: a file truncated under a mapping kills the process), checked against
what the index says (size, the checksums it lists over exactly the bytes read, the exact set of
tensor keys), and its safetensors header is parsed by hand within a size bound derived from those
keys (:mod:`~metastore_plugins.core.store.shards.shard_header`). Tensors are views of the one buffer read,
never copies.

Checksums (:data:`DIGESTS`): ``sha256`` of the whole file (every store), and ``xxh3_128`` in
journal lines written since issue 35: 20 times faster here, so the query path checks it alone
where a line lists it; ``verify``, repair and compaction check both.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor

from metastore_plugins.core.errors import StoreError, UnsupportedPlatformError
from metastore_plugins.core.records import (
    EIGENBASIS_TENSORS,
    INTEGER_TENSORS,
    SAMPLE_COLUMNS,
    batch_prefix,
    kind_tensors,
    meta_key,
    record_key,
)
from metastore_plugins.core.store.file_kinds import not_regular, os_problem
from metastore_plugins.core.store.files import StoreDir, open_regular
from metastore_plugins.core.store.shards.encoding import EXACT_KEYS
from metastore_plugins.core.store.shards.shard_header import Entry, parse_header

_SCALED_ENCODINGS = ("fp16", "int8")  # as encoding.stored_specs: every floating tensor, zero rows included


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

    Every checksum given is checked; :meth:`~metastore_plugins.core.store.shards.index.StoreIndex.expectation`
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


#: The optional columns a version 1 shard may hold (``margin`` came after version 1).
_VERSION_1_COLUMNS = tuple(column for column in SAMPLE_COLUMNS[1:] if column != "margin")


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
        required.add(meta_key(j, "sample_id"))
        if meta is None:
            optional.update(meta_key(j, column) for column in _VERSION_1_COLUMNS)
        else:
            required.update(meta_key(j, column) for column in meta)
        for k, (kind, roles) in enumerate(records):
            names = kind_tensors(kind, roles)
            required.update(record_key(j, k, name) for name in names)
            if kind == "projected":  # made on a curvature eigenbasis (exact float32 or integer: no row scales)
                optional.update(record_key(j, k, name) for name in EIGENBASIS_TENSORS)
            if scaled:  # every float tensor but the exact ones (encoding.EXACT_KEYS) has row scales
                floats = [name for name in names if name not in INTEGER_TENSORS and name not in EXACT_KEYS]
                required.update(record_key(j, k, name) + ".scale" for name in floats)
    return frozenset(required), frozenset(optional)


class ShardData:
    """The checked bytes of one shard and its parsed header.

    Tensors (:meth:`get`) are views of the one buffer read, not copies: they are shared with every
    later read of the shard in this process (:mod:`~metastore_plugins.core.store.reading.readcache`), so
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
        return list(self._by_prefix.get(batch_prefix(batch), ()))

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
        raise UnsupportedPlatformError("shards are read on little-endian hosts only (safetensors stores little-endian)")
    size_problem(path, opened, expect)
    buffer = shard_buffer(expect.bytes)  # (bytes,), filled by readinto
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


#: Buffers from this size up are mapped with their pages populated at once (:func:`shard_buffer`).
POPULATE_MIN_BYTES = 2**20


def shard_buffer(nbytes: int) -> Tensor:
    """``(nbytes,)`` uint8 memory to read a shard into (uninitialised).

    From :data:`POPULATE_MIN_BYTES` up, on Linux, an anonymous mapping made with ``MAP_POPULATE``:
    its pages come in one call instead of one page fault per 4 KiB as ``readinto`` fills them, a
    sixth of the CPU a shard's first read costs (issue 35; the tensor keeps the mapping alive).
    """
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if not populate or nbytes < POPULATE_MIN_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # (nbytes,)


def size_problem(path: Path, opened: os.stat_result, expect: ShardExpectation) -> None:
    """:class:`StoreError` when the file's size is not the one the index lists."""
    if opened.st_size != expect.bytes:
        raise StoreError(
            f"{path}: size mismatch, {opened.st_size} bytes on disk but {expect.bytes} in the index "
            "(truncated or rewritten)"
        )


def parse_shard(path: Path, buffer: Tensor, expect: ShardExpectation, identity: tuple[int, int, int, int]) -> ShardData:
    """The :class:`ShardData` of checked bytes ``buffer`` (``(bytes,)`` uint8): its header parsed and checked."""
    header, metadata, start = parse_header(path, buffer.numpy().data, expect.required, expect.optional)
    return ShardData(path, buffer, header, start, identity, metadata, (expect.required, expect.optional))


def shard_problem(path: Path, directory: Path, expect: ShardExpectation) -> str | None:
    """What :func:`read_shard` would refuse, without the leading path, or None when the shard is sound."""
    try:
        read_shard(path, directory, expect)
    except StoreError as exc:
        text = str(exc)
        return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text
    return None
