"""The nearest-gradient index's part files read as a query asks for them (bytes only), never memory-mapped.

An index of ``N`` rows of ``D`` float32 numbers is ``4 N D`` bytes (13.8 GB at 10^6 rows of the MiniLM plan's
3,456): :func:`open_part` checks a part file's sha256 by reading it through once, then gives its sample ids and
learning rates (read) and its vectors as :class:`PartRows`, whose rows are read (``os.pread``) when a query
rescores them. A map would let a file cut short by another process kill the querying one (``SIGBUS``); a read
of a file that changed since it was checked is refused instead: every read ends with an ``fstat`` compared with
the file's :func:`identity` at its check (device, inode, size, mtime and ctime: the kernel sets a file's ctime
on every write, and no ``utime`` call can set it back). The files are those of :mod:`.vector_files`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.errors import OutOfRangeError, StoreError
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.vectors.vector_files import FOLDER

#: ``(device, inode, size, mtime_ns, ctime_ns)``: a file rewritten, cut or replaced since has another.
Identity = tuple[int, int, int, int, int]
_NUMPY_DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64}
#: The largest safetensors header of a part file (its three tensors and its metadata: a few hundred bytes).
MAX_HEADER_BYTES = 1 << 16
_BLOCK = 1 << 22  # bytes hashed per read


def identity(found: os.stat_result) -> Identity:
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


@dataclass(frozen=True)
class CheckedFile:
    """A ``vector_index/`` file whose bytes were checked while it had ``identity``."""

    store_dir: Path
    name: str
    identity: Identity
    what: str

    @property
    def path(self) -> Path:
        return self.store_dir / FOLDER / self.name

    def changed(self) -> StoreError:
        return StoreError(f"{self.path}: {self.what} changed since it was checked; rebuilt by the next query")


_FDS: OrderedDict[tuple[Path, str], tuple[int, Identity]] = OrderedDict()
_FDS_LOCK = threading.Lock()
#: Part files kept open between reads (the least recently read are closed and opened again when read).
MAX_OPEN = 64


def _fd(checked: CheckedFile) -> int:
    """An open fd of ``checked`` (kept open, at most :data:`MAX_OPEN`), refused when the file changed."""
    key = (checked.store_dir, checked.name)
    kept = _FDS.get(key)
    if kept is not None and kept[1] == checked.identity:
        _FDS.move_to_end(key)
        return kept[0]
    with StoreDir(checked.store_dir) as store, store.subdir(FOLDER) as folder:
        fd, opened = folder.open_read(checked.name)
    if identity(opened) != checked.identity:
        os.close(fd)
        raise checked.changed()
    if kept is not None:
        os.close(kept[0])
    _FDS[key] = (fd, checked.identity)
    _FDS.move_to_end(key)
    while len(_FDS) > MAX_OPEN:
        os.close(_FDS.popitem(last=False)[1][0])
    return fd


def read_at(checked: CheckedFile, ranges: list[tuple[int, int]], into: memoryview | None = None) -> list[bytes]:
    """The bytes ``[begin, end)`` of each range of a checked file (or, given ``into``, those bytes one after another
    in ``into``, and ``[]``); :class:`StoreError` (one line) when the file changed since its check (cut short,
    rewritten in place, replaced): the ``fstat`` after the reads says so."""
    with _FDS_LOCK:
        try:
            fd, found, at, short = _fd(checked), [], 0, False
            for begin, end in ranges:
                if into is None:
                    found.append(os.pread(fd, end - begin, begin))
                    short = short or len(found[-1]) != end - begin
                else:
                    short = short or os.preadv(fd, [into[at : at + end - begin]], begin) != end - begin
                    at += end - begin
            same = identity(os.fstat(fd)) == checked.identity
        except OSError as exc:
            raise StoreError(f"{checked.path}: {checked.what} could not be read ({exc.strerror})") from None
    if short or not same:
        raise checked.changed()
    return found


def open_part(store_dir: Path, name: str, expected_sha256: str, cap: int, what: str) -> dict[str, Any]:
    """A part file checked (regular, at most ``cap`` bytes, its sha256 ``expected_sha256``): its tensors,
    ``"sample_id"`` and ``"lr"`` read, ``"vector"`` a :class:`PartRows`, and its safetensors ``"__metadata__"``.
    :class:`StoreError` (one line naming the file) when it is not."""
    path = store_dir / FOLDER / name
    with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
        fd, opened = folder.open_read(name)
    checked = CheckedFile(store_dir, name, identity(opened), what)
    try:
        if not 8 < opened.st_size <= cap:
            raise StoreError(f"{path}: {what} of {opened.st_size} bytes (at most {cap} expected)")
        digest, head = hashlib.sha256(), b""
        for begin in range(0, opened.st_size, _BLOCK):
            block = os.pread(fd, min(_BLOCK, opened.st_size - begin), begin)
            digest.update(block)
            head = head or block[: 8 + MAX_HEADER_BYTES]
        if identity(os.fstat(fd)) != checked.identity:
            raise checked.changed()
    finally:
        os.close(fd)
    if digest.hexdigest() != expected_sha256:
        raise StoreError(f"{path}: {what} does not match the sha256 its manifest records")
    header, layout = part_layout(head, opened.st_size, path)
    tensors: dict[str, Any] = {"__metadata__": header.get("__metadata__")}
    small = [key for key in layout if key != "vector"]
    for key, data in zip(small, read_at(checked, [layout[key][:2] for key in small])):
        tensors[key] = np.frombuffer(data, layout[key][2]).reshape(layout[key][3]).copy()
    if "vector" in layout:
        begin, _, dtype, shape = layout["vector"]
        if dtype != np.float32 or len(shape) != 2:
            raise StoreError(f"{path}: not a part file (its vectors are not (n, D) float32)")
        tensors["vector"] = PartRows(checked, begin, shape[0], shape[1])
    return tensors


def part_layout(
    head: bytes, size: int, path: Path
) -> tuple[dict[str, Any], dict[str, tuple[int, int, np.dtype, tuple[int, ...]]]]:
    """``(header, {tensor: (begin, end, dtype, shape)})`` of a part file of ``size`` bytes from its first bytes;
    :class:`StoreError` when its header is not a part's (bounded: at most :data:`MAX_HEADER_BYTES` parsed)."""
    try:
        length = int.from_bytes(head[:8], "little")
        if length > MAX_HEADER_BYTES or 8 + length > len(head):
            raise StoreError(f"a header of {length} bytes")
        header = json.loads(head[8 : 8 + length])
        layout = {}
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            begin, end = (8 + length + int(o) for o in spec["data_offsets"])
            dtype, shape = np.dtype(_NUMPY_DTYPES[spec["dtype"]]), tuple(int(n) for n in spec["shape"])
            if any(n < 0 for n in shape) or not 8 + length <= begin <= end <= size:
                raise StoreError(f"{key} lies outside the file")
            if end - begin != dtype.itemsize * int(np.prod(shape, dtype=object)):
                raise StoreError(f"{key}'s bytes are not its shape's")
            layout[str(key)] = (begin, end, dtype, shape)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise StoreError(f"{path}: not a part file ({exc})") from None
    return header, layout


class PartRows:
    """A checked part's ``(n, D)`` float32 vectors on disk: ``rows[i]`` (an index array or a slice) and
    ``np.asarray(rows)`` read those rows now (:func:`read_at`), refused when the file changed since its check."""

    def __init__(self, checked: CheckedFile, offset: int, rows: int, width: int) -> None:
        self.checked, self.offset = checked, offset
        self.shape = (rows, width)
        self.dtype = np.dtype(np.float32)
        self.nbytes = rows * width * 4

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice | np.ndarray | list[int]) -> np.ndarray:
        rows = np.arange(*key.indices(len(self))) if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        rows = rows.reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise OutOfRangeError(f"rows out of 0..{len(self) - 1}")
        step, out = 4 * self.shape[1], np.empty((len(rows), self.shape[1]), np.float32)  # (n, D)
        starts = np.flatnonzero(np.diff(rows, prepend=-2) != 1)  # runs of consecutive rows: one read each
        ends = np.append(starts[1:], len(rows)) - 1
        ranges = [
            (self.offset + int(rows[a]) * step, self.offset + (int(rows[b]) + 1) * step) for a, b in zip(starts, ends)
        ]
        read_at(self.checked, ranges, out.reshape(-1).view(np.uint8).data)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[slice(None)]
        return whole if dtype is None else whole.astype(dtype)
