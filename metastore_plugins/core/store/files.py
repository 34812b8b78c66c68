"""The one way the package opens, creates, renames and removes a file inside a store directory.

A :class:`StoreDir` holds a directory open by fd and works relative to it (``dir_fd=``): the
store root may be reached through a user's link, but nothing inside it ever is. Every entry is
opened ``O_NOFOLLOW`` (a link is refused, never followed) and ``O_NONBLOCK`` (a FIFO never
blocks), checked with ``lstat`` before and ``fstat`` after (only regular files are read or
written; a file swapped in between is refused), and reads are bounded. Files are replaced
atomically through a temporary created ``O_EXCL`` under an unguessable name
(:data:`~metastore_plugins.core.store.file_kinds.TEMPORARY_NAME`), so nobody can plant a file or
link where a writer will write. What an entry is when it is not a regular file, in words:
:mod:`~metastore_plugins.core.store.file_kinds`.

Refusals raise :class:`StoreError` naming the path and what to do; disk errors (a full disk)
stay ``OSError``, which writers report as such.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.file_kinds import kind_of, not_regular, os_problem

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
#: Opening an entry to read it: never through a link, never waiting on a FIFO.
READ_FLAGS = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC
#: Opening (or creating) an entry to write it in place: a journal, a lock.
_RDWR_FLAGS = os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC
#: Creating a temporary: only a new file, never an existing file or link.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_MODE = 0o644
_READ_BLOCK = 1 << 20


def _check_name(directory: Path, name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name or (os.sep != "/" and os.sep in name):
        raise StoreError(f"{directory}: {name!r} is not the name of an entry of this directory")


class StoreDir:
    """A directory of the store held open by fd; every operation is relative to it and refuses links.

    ``StoreDir(path)`` opens ``path`` itself following links (a store root a user linked to);
    :meth:`subdir` opens entries below it ``O_NOFOLLOW``. With ``create``, ``path`` is created
    (parents included). Raises :class:`StoreError` naming the path when it is not a directory.
    """

    def __init__(self, path: Path, *, create: bool = False) -> None:
        self.path = Path(path)
        self.fd = -1
        try:
            if create:
                self.path.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        except FileExistsError as exc:
            raise StoreError(f"{self.path}: exists and is not a directory; pick a directory path") from exc
        except NotADirectoryError as exc:
            raise StoreError(f"{self.path}: is not a directory; pick a directory path") from exc
        except FileNotFoundError as exc:
            raise StoreError(f"{self.path}: no such directory") from exc

    @classmethod
    def _adopt(cls, fd: int, path: Path) -> StoreDir:
        self = cls.__new__(cls)
        self.path, self.fd = path, fd
        return self

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> StoreDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # -- entries -------------------------------------------------------------------------------

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's ``lstat`` (a link is not followed), or None when there is none."""
        _check_name(self.path, name)
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        """Whether an entry ``name`` exists, of any kind (a dangling link too)."""
        return self.lstat(name) is not None

    def kind(self, name: str) -> str | None:
        """``"file"``, ``"directory"``, ``"link"``, ``"special"``, or None when there is no such entry."""
        found = self.lstat(name)
        return None if found is None else kind_of(found.st_mode)

    def listdir(self) -> list[str]:
        return os.listdir(self.fd)

    def fsync(self) -> None:
        """Make the directory's entries (a rename, a new file) durable."""
        try:
            os.fsync(self.fd)
        except OSError:  # pragma: no cover - filesystems where directories cannot be synced
            pass

    def subdir(self, name: str, *, create: bool = False) -> StoreDir:
        """The subdirectory ``name`` (created with ``create``), refused when it is a link or not a directory."""
        _check_name(self.path, name)
        path = self.path / name
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
                self.fsync()
            except FileExistsError:
                pass
        try:
            fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            found = self.lstat(name)
            if found is None:
                raise StoreError(f"{path}: no such directory") from exc
            if stat.S_ISLNK(found.st_mode):
                raise StoreError(
                    f"{path}: is a symbolic link; a store's folders are never reached through links: "
                    "remove the link (or replace it by a real directory)"
                ) from exc
            if not stat.S_ISDIR(found.st_mode):
                raise StoreError(f"{path}: is not a directory; remove or rename it") from exc
            raise StoreError(f"{path}: cannot be opened ({exc.strerror or exc}); check its permissions") from exc
        return StoreDir._adopt(fd, path)

    # -- reading -------------------------------------------------------------------------------

    def open_read(self, name: str) -> tuple[int, os.stat_result]:
        """A read-only fd of the regular file ``name`` and its ``fstat``; the caller closes it.

        A link, FIFO, socket, device or directory is refused unopened; a file swapped between
        the check and the open is refused.
        """
        path = self.path / name
        try:
            before = self.lstat(name)
        except OSError as exc:
            raise StoreError(f"{path}: {os_problem(exc)}") from exc
        if before is None:
            raise StoreError(f"{path}: missing on disk")
        problem = not_regular(before.st_mode)
        if problem is not None:
            raise StoreError(f"{path}: {problem}")
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            raise StoreError(f"{path}: {os_problem(exc)}") from exc
        opened = os.fstat(fd)
        if not_regular(opened.st_mode) is not None or (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise StoreError(f"{path}: was replaced while it was opened; not read")
        return fd, opened

    def read(self, name: str, cap: int, what: str) -> bytes:
        """The whole regular file ``name``, refused above ``cap`` bytes or when it grows past ``cap`` while read.

        Memory follows the file's size, never the cap.
        """
        path = self.path / name
        fd, opened = self.open_read(name)
        if opened.st_size > cap:
            os.close(fd)
            raise StoreError(
                f"{path}: {what} of {opened.st_size} bytes is larger than the {cap} bytes a reader accepts"
            )
        chunks, total = [], 0
        with io.FileIO(fd, "rb", closefd=True) as handle:
            while total <= cap:  # the size fstat gave, then blocks to the end: one grown past the cap is refused
                block = handle.read(opened.st_size - total if total < opened.st_size else _READ_BLOCK)
                if not block:
                    break
                chunks.append(block)
                total += len(block)
        if total > cap:
            raise StoreError(f"{path}: {what} grew past {cap} bytes while it was read")
        return b"".join(chunks)

    # -- writing -------------------------------------------------------------------------------

    def _refuse_non_file(self, name: str, found: os.stat_result | None) -> None:
        problem = None if found is None else not_regular(found.st_mode)
        if problem is not None:
            raise StoreError(f"{self.path / name}: {problem}; remove it (it is not the store's file)")

    def atomic_write(self, name: str, data: bytes | Callable[[BinaryIO], object]) -> None:
        """Replace ``name`` whole: a new temporary (``O_EXCL``, unguessable name) written, fsynced, renamed over it.

        ``data``: the bytes, or a function writing them to a binary file. A link at ``name`` is
        replaced, never written through; a directory there is refused. On failure the temporary
        is removed and ``name`` is as it was.
        """
        _check_name(self.path, name)
        if self.kind(name) == "directory":
            raise StoreError(f"{self.path / name}: is a directory, not a regular file; remove or rename it")
        tmp = f"{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, _CREATE_FLAGS, _MODE, dir_fd=self.fd)
        try:
            with io.FileIO(fd, "wb", closefd=True) as raw, io.BufferedWriter(raw) as handle:
                if callable(data):
                    data(handle)
                else:
                    handle.write(data)
                handle.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise
        self.fsync()

    def _open_in_place(self, name: str) -> int:
        """``O_RDWR | O_CREAT`` of a regular file (never a link, FIFO, device or directory)."""
        before = self.lstat(name)
        self._refuse_non_file(name, before)
        try:
            fd = os.open(name, _RDWR_FLAGS, _MODE, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # swapped in after the check
                raise StoreError(f"{self.path / name}: {os_problem(exc)}; remove it") from exc
            raise
        opened = os.fstat(fd)
        same = before is None or (opened.st_dev, opened.st_ino) == (before.st_dev, before.st_ino)
        if not_regular(opened.st_mode) is not None or not same:
            os.close(fd)
            raise StoreError(f"{self.path / name}: was replaced while it was opened; not written")
        if before is None:
            self.fsync()  # the new file's name
        return fd

    def open_append(self, name: str, good_size: int) -> int:
        """An fd of the regular file ``name`` (created if missing), cut to ``good_size`` bytes when longer."""
        fd = self._open_in_place(name)
        try:
            size = os.fstat(fd).st_size
            if size < good_size:
                raise StoreError(
                    f"{self.path / name}: holds {size} bytes, fewer than the {good_size} just read; another "
                    "program is changing it: stop it and retry"
                )
            if size > good_size:
                os.ftruncate(fd, good_size)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def append(fd: int, offset: int, data: bytes) -> None:
        """Write ``data`` whole at ``offset`` and fsync; on failure cut the file back to ``offset`` and re-raise."""
        try:
            view, at = memoryview(data), offset
            while view:
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, offset)
            except OSError:
                pass  # a torn tail is ignored by readers and dropped by the next writer
            raise

    def open_lock(self, name: str) -> int:
        """An ``O_RDWR`` fd of the regular file ``name`` (created if missing) to lock; the caller closes it."""
        return self._open_in_place(name)

    def move_into(self, name: str, to: StoreDir) -> str:
        """Move entry ``name`` (a file or link, never a directory) into ``to`` under a free name: ``name``,
        else ``name.1``, ``name.2``... (never over an entry there); returns the name it took. Both fsynced."""
        found = self.lstat(name)
        if found is None or stat.S_ISDIR(found.st_mode):
            raise StoreError(
                f"{self.path / name}: {'missing on disk' if found is None else 'is a directory'}; not moved"
            )
        target, n = name, 0
        while True:
            while to.exists(target):
                n += 1
                target = f"{name}.{n}"
            try:  # a hard link fails where the target exists: no entry of ``to`` is ever replaced
                os.link(name, target, src_dir_fd=self.fd, dst_dir_fd=to.fd, follow_symlinks=False)
            except FileExistsError:
                continue  # taken meanwhile: the next free name
            except OSError:  # no hard links on this filesystem: a rename to the name just found free
                os.rename(name, target, src_dir_fd=self.fd, dst_dir_fd=to.fd)
                break
            os.unlink(name, dir_fd=self.fd)
            break
        to.fsync()
        self.fsync()
        return target

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        """Unlink the entry ``name`` (a link itself, never its target); a directory is refused."""
        found = self.lstat(name)
        if found is None:
            if missing_ok:
                return
            raise StoreError(f"{self.path / name}: missing on disk")
        if stat.S_ISDIR(found.st_mode):
            raise StoreError(f"{self.path / name}: is a directory; not removed")
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise


def open_under(root: Path, directory: Path, *, create: bool = False) -> StoreDir:
    """``directory`` as a :class:`StoreDir`: when it lies inside ``root`` (a folder of the store, such as
    ``<store>/reports``), each folder below ``root`` is opened with :meth:`StoreDir.subdir` (a link is
    refused); elsewhere (a folder the user named) it is opened as given. ``create``: folders are created."""
    try:
        parts = Path(os.path.abspath(directory)).relative_to(os.path.abspath(root)).parts
    except ValueError:
        return StoreDir(directory, create=create)
    current = StoreDir(root)
    for part in parts:
        try:
            below = current.subdir(part, create=create)
        finally:
            current.close()
        current = below
    return current


def _entry_of(path: Path, directory: Path) -> StoreDir:
    """``directory`` opened, refused unless ``path`` is one of its entries."""
    if path.parent != directory:
        raise StoreError(f"{path}: is not a file of the store directory {directory}; not read")
    return StoreDir(directory)


def open_regular(path: Path, directory: Path) -> tuple[int, os.stat_result]:
    """:meth:`StoreDir.open_read` of ``path``, which must be an entry of ``directory``."""
    with _entry_of(path, directory) as opened:
        return opened.open_read(path.name)


def read_bounded(path: Path, directory: Path, cap: int, what: str) -> bytes:
    """:meth:`StoreDir.read` of ``path``, which must be an entry of ``directory``."""
    with _entry_of(path, directory) as opened:
        return opened.read(path.name, cap, what)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """:meth:`StoreDir.atomic_write` of ``data`` over ``path`` (its directory opened as the store's root)."""
    with StoreDir(path.parent) as opened:
        opened.atomic_write(path.name, data)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (no-op where it cannot be opened)."""
    try:
        opened = StoreDir(directory)
    except (StoreError, OSError):
        return
    with opened:
        opened.fsync()
