"""Shards already read and checked in this process, kept within a memory allowance and reused unread.

Every query reads whole shards and checks them (:mod:`~metastore_plugins.core.store.shards.shardread`).
A second query over the same store (influence, then self-influence), or another store opened on
the same directory, finds here the bytes checked the first time: it opens the file as before
(a regular file of the store, never a link; :meth:`~metastore_plugins.core.store.files.StoreDir.open_read`)
and compares its identity ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` with the one
the bytes were read under. The same file, unchanged, costs that ``fstat`` instead of a read and
a checksum; a file replaced, rewritten, truncated or touched since is read and checked again.
Bytes changed in place through torch (a caller writing into a tensor it was lent) are noticed
(:meth:`ShardData.intact`) and read again too.

The allowance (:func:`allowance`): ``METASTORE_SHARD_CACHE_BYTES`` when set (``0`` turns the
cache off), else a quarter of physical memory, at most :data:`DEFAULT_MAX_BYTES`. The least
recently used shards are dropped first; a shard larger than the allowance is read but not kept.
Tensors handed out keep their shard's bytes alive after it is dropped, until they are freed.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.store.files import open_regular
from metastore_plugins.core.store.shards.shardread import (
    ShardData,
    ShardExpectation,
    check_digests,
    parse_shard,
    read_opened,
    size_problem,
)

#: The default allowance's ceiling: a quarter of physical memory up to this.
DEFAULT_MAX_BYTES = 4 * 2**30
ENV_VAR = "METASTORE_SHARD_CACHE_BYTES"

Identity = tuple[int, int, int, int, int]


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - no sysconf (Windows)
        return 4 * DEFAULT_MAX_BYTES


def allowance() -> int:
    """Bytes of shards the cache may hold: ``$METASTORE_SHARD_CACHE_BYTES``, else ``min(RAM / 4, 4 GiB)``."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ConfigError(
                f"{ENV_VAR}={value!r} is not a number of bytes; set it to an integer (0: no cache)"
            ) from None
    return min(_physical_memory() // 4, DEFAULT_MAX_BYTES)


@dataclass
class _Kept:
    path: str
    data: ShardData
    checked: dict[str, str] = field(default_factory=dict)  # checksum name -> the hex these bytes matched


class ShardCache:
    """Checked shards by file identity, least recently used dropped first beyond ``max_bytes``
    (None: :func:`allowance`, read at each insertion)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[Identity, _Kept] = OrderedDict()
        self._reading: dict[Identity, threading.Event] = {}  # files being read now, by identity
        self.reads = 0  # shards read from disk (the others came from memory)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        with self._lock:
            return sum(kept.data.nbytes for kept in self._kept.values())

    def limit(self) -> int:
        """The allowance in bytes: ``max_bytes``, else :func:`allowance` (read now)."""
        return allowance() if self.max_bytes is None else self.max_bytes

    def clear(self) -> None:
        """Drop every shard (tensors already handed out stay valid)."""
        with self._lock:
            self._kept.clear()

    @contextmanager
    def within(self, max_bytes: int) -> Iterator[None]:
        """Hold at most ``max_bytes`` (or the allowance, if smaller) inside the block; emptied after it, the
        earlier allowance back. What a training process's reports use: shards read again cost a read and a
        checksum (page cache, xxh3), where keeping a whole store would cost its bytes of the trainer's memory."""
        before = self.max_bytes
        self.max_bytes = min(self.limit(), max_bytes)
        try:
            yield
        finally:
            self.max_bytes = before
            self.clear()

    def read(self, path: Path, directory: Path, expect: ShardExpectation) -> ShardData:
        """Shard ``path`` checked against ``expect``: the bytes kept for this file when its identity is
        unchanged (the checksums they were not yet checked against checked in memory, the header
        parsed again for other expected keys), else read from disk, checked and kept. A file another
        thread is reading (a read ahead) is waited for and then looked up again, not read twice.
        :class:`StoreError` starting with the path when it is not sound."""
        while True:
            found = self._read_once(path, directory, expect)
            if isinstance(found, ShardData):
                return found
            found.wait()  # kept when that read succeeded; else read here, and its error raised here

    def _read_once(self, path: Path, directory: Path, expect: ShardExpectation) -> ShardData | threading.Event:
        """:meth:`read`, or the event of another thread's read of the same file to wait for."""
        fd, opened = open_regular(path, directory)  # a regular file of the store, never through a link
        try:
            size_problem(path, opened, expect)
            identity = (opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns, opened.st_ctime_ns)
            with self._lock:
                kept = self._kept.get(identity)
                if kept is not None and (kept.path != str(path) or not kept.data.intact()):
                    del self._kept[identity]  # another file that took a freed inode, or bytes changed in place
                    kept = None
                if kept is not None:
                    self._kept.move_to_end(identity)
                elif identity in self._reading:
                    return self._reading[identity]
                else:
                    self._reading[identity] = threading.Event()
            if kept is not None:
                return self._reuse(kept, path, expect)
            try:
                data = read_opened(fd, opened, path, expect)
                with self._lock:
                    self.reads += 1  # a read-ahead thread reads beside the caller's
                self._keep(identity, _Kept(str(path), data, expect.digests()))
            finally:
                with self._lock:
                    self._reading.pop(identity).set()
            return data
        finally:
            os.close(fd)

    def _reuse(self, kept: _Kept, path: Path, expect: ShardExpectation) -> ShardData:
        wanted = {
            name: hexdigest for name, hexdigest in expect.digests().items() if kept.checked.get(name) != hexdigest
        }
        if wanted:
            check_digests(path, kept.data.buffer(), wanted)  # in memory: no read
            kept.checked.update(wanted)
        data = kept.data
        if data.expected != (expect.required, expect.optional):
            data = parse_shard(path, data.raw(), expect, data.identity)  # the same bytes, other keys
        return data

    def _keep(self, identity: Identity, kept: _Kept) -> None:
        limit = self.limit()
        size = kept.data.nbytes
        if size > limit:
            return
        with self._lock:
            self._kept[identity] = kept
            total = sum(k.data.nbytes for k in self._kept.values())
            while total > limit:
                _, dropped = self._kept.popitem(last=False)
                total -= dropped.data.nbytes


#: The process's cache, used by every store's reads (:class:`~metastore_plugins.core.store.reading.batches.ShardFiles`).
SHARDS = ShardCache()
