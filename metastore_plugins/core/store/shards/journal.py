"""The index journal of one rank: ``index-rank{r}.jsonl``, one line per shard, appended and fsynced.

Adding a shard appends one line, whatever the run's length (the version 1 manifest was
rewritten whole after every shard). A line is ``{json} {crc32:08x}\\n``: the JSON text (ASCII)
and the CRC-32 of its bytes. A line that does not end in a newline (a torn tail: the process
died while appending) or whose CRC does not match is ignored and reported, never trusted.

The JSON object of a line describes one shard (every field and bound: docs/format.md)::

    {"file": "rank0-000003.safetensors", "bytes": 1234, "sha256": "...", "encoding": "fp16",
     "capture_points": ["train"], "layers": ["fc1", "fc2"],
     "batches": {"capture_point": ["i4", b64], "step": ["i8", b64], "epoch": ..., "micro_batch": ...,
                 "size": ..., "lr": ["f8", b64], "meta": ["u1", b64]},
     "records": {"batch": ..., "layer": ..., "kind": ["u1", b64], "rows": ..., "bytes": ..., "dense_bytes": ...},
     "samples": {"sample_id": ["i8", b64], "label": ..., "loss": ["f4", b64], "prediction": ...,
                 "margin": ["f4", b64]}}

Columns are little-endian arrays in base64; ``capture_point`` and ``layer`` index the line's
name lists; ``lr`` is NaN where none was given; ``meta`` is a bit mask of the optional metadata
tensors the shard holds for the batch (:data:`~metastore_plugins.core.records.META_BITS`); ``kind`` codes
record kinds (:data:`~metastore_plugins.core.records.KIND_CODES`).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import xxhash

from metastore_plugins.core.errors import ConfigError, JournalError, StoreError
from metastore_plugins.core.store.files import StoreDir, atomic_write_bytes
from metastore_plugins.core.store.shards.manifest import json_values_problem
from metastore_plugins.core.store.writable import COPY_TO_WRITE, writing

T = TypeVar("T")

#: Dtype codes a column may use (all little-endian).
DTYPES: dict[str, np.dtype[Any]] = {
    code: np.dtype(f"<{code}") for code in ("i1", "u1", "i2", "i4", "i8", "f4", "f8", "b1")
}
#: The longest line a reader accepts (a shard of 64 MiB of a tiny MLP needs about 15 MiB).
MAX_LINE_BYTES = 256 * 2**20
#: The most JSON values a line may hold, counted before parsing (:func:`json_values_problem`): a line names at
#: most 2^16 capture points and 2^16 layers beside a few dozen columns, so a writer's line holds fewer than 2^17 + 100;
#: parsing a line at the cap takes about 70 MB (a 200 MB line of ``{},`` would take 5 GB).
MAX_LINE_VALUES = 2**20
_LINE = re.compile(rb"^(\{.*\}) ([0-9a-f]{8})$", re.DOTALL)


def journal_name(rank: int) -> str:
    return f"index-rank{rank}.jsonl"


def pack(values: np.ndarray) -> list[str]:
    """``[dtype code, base64 of the little-endian bytes]`` of a 1-d array."""
    array = np.ascontiguousarray(values)
    code = next((c for c, d in DTYPES.items() if d == array.dtype.newbyteorder("<")), None)
    if code is None or array.ndim != 1:
        raise ConfigError(f"a journal column must be a 1-d array of {sorted(DTYPES)}; got {array.dtype} {array.shape}")
    return [code, base64.b64encode(array.astype(DTYPES[code], copy=False).tobytes()).decode("ascii")]


def unpack(value: Any, where: str) -> np.ndarray:
    """The array of a packed column; raise :class:`JournalError` naming ``where``."""
    if not (isinstance(value, list) and len(value) == 2 and value[0] in DTYPES and isinstance(value[1], str)):
        raise JournalError(f"{where} must be [dtype code, base64 text] with a code of {sorted(DTYPES)}")
    try:
        raw = base64.b64decode(value[1], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise JournalError(f"{where} is not valid base64 ({exc})") from exc
    dtype = DTYPES[value[0]]
    if len(raw) % dtype.itemsize:
        raise JournalError(f"{where} holds {len(raw)} bytes, not a whole number of {value[0]} values")
    return np.frombuffer(raw, dtype=dtype)


def encode_line(entry: dict[str, Any]) -> bytes:
    """One journal line for ``entry`` (columns already packed)."""
    text = json.dumps(entry, separators=(",", ":"), allow_nan=False).encode("ascii")
    return text + b" " + f"{zlib.crc32(text):08x}".encode() + b"\n"


def decode_line(line: bytes) -> dict[str, Any]:
    """The JSON object of a complete line (with its newline); :class:`JournalError` when it cannot be trusted."""
    if not line.endswith(b"\n"):
        raise JournalError("torn: the line does not end (the writer stopped while appending it)")
    match = _LINE.match(line[:-1])
    if match is None:
        raise JournalError("damaged: not a '{json} crc32' line")
    text, crc = match.groups()
    if f"{zlib.crc32(text):08x}".encode() != crc:
        raise JournalError("damaged: its CRC-32 does not match its content")
    problem = json_values_problem(text, MAX_LINE_VALUES)
    if problem is not None:
        raise JournalError(problem)
    try:
        entry = json.loads(text)
    except (ValueError, RecursionError, MemoryError) as exc:
        raise JournalError(f"damaged: not JSON ({exc or 'out of memory while parsing it'})") from exc
    if not isinstance(entry, dict):
        raise JournalError("damaged: not a JSON object")
    return entry


def read_lines(handle: Any) -> Iterator[tuple[int, bytes | None, int]]:
    """``(line number from 1, line or None when longer than MAX_LINE_BYTES, offset after it)``."""
    number, offset = 0, 0
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_BYTES:
            offset += len(line)
            while True:  # skip the rest of the overlong line a block at a time (readline scans slowly)
                block = handle.read(1 << 20)
                end = block.find(b"\n")
                if end >= 0:
                    handle.seek(end + 1 - len(block), os.SEEK_CUR)
                    offset += end + 1
                    break
                offset += len(block)
                if not block:
                    break
            yield number, None, offset
            continue
        offset += len(line)
        yield number, line, offset


class JournalAppender:
    """Appends lines to a journal of the store (index, snapshot checksums, tags), each written whole
    and fsynced before :meth:`append` returns: the store's one fsync-append."""

    def __init__(self, directory: StoreDir, name: str, good_size: int) -> None:
        """Open journal ``name`` of ``directory`` (never through a link; created if missing) after cutting
        it to ``good_size`` (dropping a torn tail)."""
        self.path = directory.path / name
        self._fd = directory.open_append(name, good_size)
        self.size = good_size

    def append(self, line: bytes) -> None:
        """Write ``line`` at the end and fsync; on failure cut the journal back to where it was."""
        StoreDir.append(self._fd, self.size, line)
        self.size += len(line)

    def cut(self, size: int) -> None:
        """Cut the journal back to ``size`` bytes: lines appended since then are taken back."""
        os.ftruncate(self._fd, size)
        self.size = size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def lock_name(rank: int) -> str:
    return f"rank{rank}.lock"


#: Lock files held by this process, by (device, inode): POSIX locks do not conflict within a process.
_HELD: set[tuple[int, int]] = set()
_HELD_LOCK = threading.Lock()


class RankLock:
    """An exclusive lock on ``rank{r}.lock``, held by the one writer, compaction or repair of a rank
    (a file never replaced, so the lock outlives journal rewrites). Taken without waiting: a busy
    lock is a clear error.

    A POSIX record lock (``lockf``) between processes, which processes forked while it is held (a
    DataLoader's workers) do not inherit, unlike ``flock``; within this process a registry of held
    lock files. Where ``fcntl`` is missing (Windows) only the registry applies. A directory this process
    cannot write (read-only, no permission) raises :class:`~metastore_plugins.core.errors.StoreNotWritableError`.
    """

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / lock_name(rank)
        with StoreDir(directory) as opened, writing(directory, COPY_TO_WRITE):  # a read-only store: one line
            self._fd = opened.open_lock(lock_name(rank))  # never through a link, never a directory or FIFO
        stat = os.fstat(self._fd)
        self._key = (stat.st_dev, stat.st_ino)
        with _HELD_LOCK:
            busy = self._key in _HELD or not _lock(self._fd)
            if not busy:
                _HELD.add(self._key)
        if busy:
            os.close(self._fd)
            self._fd = -1
            raise StoreError(
                f"{directory} rank {rank} is in use by another writer, compaction or repair (it holds "
                f"{self.path.name}); wait for it to finish: one writer per store directory and rank"
            )

    def release(self) -> None:
        if self._fd >= 0:
            with _HELD_LOCK:
                _HELD.discard(self._key)
                os.close(self._fd)  # releases the POSIX lock
            self._fd = -1

    def __enter__(self) -> RankLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(fd: int) -> bool:
    """Whether an exclusive POSIX lock on ``fd`` was taken without waiting."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EACCES or EAGAIN: held by another process
        return False
    return True


def rewrite(path: Path, lines: list[bytes]) -> None:
    """Replace the journal atomically by ``lines`` (compaction and repair; under :class:`RankLock`)."""
    atomic_write_bytes(path, b"".join(lines))  # through a new temporary: never a planted file or link


class ParsedPrefixes(Generic[T]):
    """What this process parsed of journals (the snapshot journals, the tag books), kept by path and reused
    while the bytes it was parsed from are unchanged: a reader reads the file whole as before, hashes the part
    parsed before (xxh3-128, about 10 GB/s) and parses only the lines appended since. A file rewritten, cut or
    replaced anywhere in that part (whatever its size, mtime or ctime say) is parsed again from its start.
    """

    def __init__(self, capacity: int = 16) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[int, str, T]] = OrderedDict()
        self._capacity = capacity

    def get(self, key: str, data: bytes) -> tuple[int, T] | None:
        """``(bytes parsed, state)`` of ``key`` when ``data`` begins with the bytes that state was parsed from."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or len(data) < entry[0]:
            return None
        upto, digest, state = entry
        return (upto, state) if xxhash.xxh3_128_hexdigest(memoryview(data)[:upto]) == digest else None

    def put(self, key: str, data: bytes, upto: int, state: T) -> None:
        """Keep ``state``, parsed from ``data[:upto]``, for ``key`` (the least recently kept goes past capacity)."""
        digest = xxhash.xxh3_128_hexdigest(memoryview(data)[:upto])
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (upto, digest, state)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
