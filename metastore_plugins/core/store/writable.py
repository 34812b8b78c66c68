"""A directory this process cannot write (a read-only filesystem, no permission), said in one line.

What writes into a store (capture, compaction, repair, the reports into ``<store>/reports``) turns the
``OSError`` the operating system gives (``EROFS``, ``EACCES``, ``EPERM``) into
:class:`~metastore_plugins.core.errors.StoreNotWritableError`, naming the directory and what to do.
What only reads never needs to write: its caches (sketches, the nearest-gradient index) are skipped
where they cannot be written (:mod:`.vectors.sketch_cache`, :mod:`.vectors.vector_files`). A full disk (``ENOSPC``) is
not this: it stays an ``OSError``, which writers report as a disk error.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from metastore_plugins.core.errors import StoreNotWritableError

#: The ``errno`` values that mean this process may not write there (not: the disk is full).
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})

#: What to do with a store that cannot be written, when the command has to write into it.
COPY_TO_WRITE = (
    "copy the store to a writable directory (cp -r) and run it on the copy; inspect, verify (without "
    "--repair) and the queries read a read-only store as it is"
)


def not_writable(directory: Path, exc: OSError, fix: str) -> StoreNotWritableError:
    """The error for ``exc`` (one of :data:`NOT_WRITABLE`) met writing into ``directory``."""
    why = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
    return StoreNotWritableError(f"{directory} cannot be written ({why}); {fix}")


@contextlib.contextmanager
def writing(directory: Path, fix: str) -> Iterator[None]:
    """Inside it, an ``OSError`` of :data:`NOT_WRITABLE` becomes :func:`not_writable`'s error; others pass."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        raise not_writable(directory, exc, fix) from exc


def check_writable(directory: Path, fix: str) -> None:
    """Raise :func:`not_writable`'s error now when ``directory`` (or, where it is missing, the nearest folder
    above it, in which it would be created) cannot be written: asked of the kernel (``access(2)``, which says
    ``EROFS`` for a read-only mount), before a long computation whose result would be lost."""
    existing = Path(os.path.abspath(directory))
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    try:
        writable = os.access(existing, os.W_OK | os.X_OK)
    except OSError:  # pragma: no cover - access(2) itself failing: let the write say what is wrong
        return
    if not writable:
        code = errno.EROFS if _read_only_mount(existing) else errno.EACCES
        raise not_writable(directory, OSError(code, os.strerror(code)), fix)


def _read_only_mount(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem mounted read-only (``statvfs``'s ``ST_RDONLY``)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # pragma: no cover - no statvfs (Windows)
        return False
