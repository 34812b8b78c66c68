"""The nearest-gradient index's files memory-mapped (bytes only): a part's rows read as a query asks for them.

An index of ``N`` rows of ``D`` float32 numbers is ``4 N D`` bytes (13.8 GB at 10^6 rows of the MiniLM plan's
3,456): :func:`map_checked` maps a part file read-only once its sha256 is checked, and :func:`part_arrays` gives
its tensors as numpy views of the map, so only the rows a query rescores are read (from the page cache, or
the disk). The files are those of :mod:`.vector_files`, found and checked the same way.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.store.files import StoreDir, StoreError
from metastore_plugins.core.store.vector_files import FOLDER


def map_checked(store_dir: Path, name: str, expected_sha256: str, cap: int, what: str) -> mmap.mmap:
    """``vector_index/name`` memory-mapped read-only (:func:`read`'s checks, then its sha256 over the map): a part's
    rows are read from the page cache when a query asks for them. The project never rewrites a file in place
    (it replaces it), so the map keeps the bytes checked; a file cut short in place by hand may end a read."""
    with StoreDir(store_dir) as store, store.subdir(FOLDER) as folder:
        fd, opened = folder.open_read(name)
    try:
        if not 0 < opened.st_size <= cap:
            raise StoreError(f"{store_dir / FOLDER / name}: {what} of {opened.st_size} bytes (at most {cap} expected)")
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    if hashlib.sha256(mapped).hexdigest() != expected_sha256:
        raise StoreError(f"{store_dir / FOLDER / name}: {what} does not match the sha256 its manifest records")
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)  # a query reads a few hundred rows: no read-ahead around each
    return mapped


_NUMPY_DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def part_arrays(data: Any) -> dict[str, np.ndarray]:
    """The tensors of a part file's bytes (or map) as numpy views of them, nothing copied; :class:`StoreError`
    when its header is not a part's (a damaged file that passed its sha256 cannot be, but a foreign one)."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + size]))
        found = {}
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            begin, end = (8 + size + int(o) for o in spec["data_offsets"])
            dtype, shape = np.dtype(_NUMPY_DTYPES[spec["dtype"]]), tuple(int(n) for n in spec["shape"])
            if not 8 + size <= begin <= end <= len(data) or end - begin != dtype.itemsize * int(np.prod(shape)):
                raise ValueError(f"{key} lies outside the file")
            found[key] = np.frombuffer(data, dtype, int(np.prod(shape)), begin).reshape(shape)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise StoreError(f"not a part file ({exc})") from None
    return found
