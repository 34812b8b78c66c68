"""What an entry of a store directory is: its kind by mode, why it is not read, and temporaries' names.

:class:`~metastore_plugins.core.store.files.StoreDir` reads and writes regular files only; these
name what it met instead, in the words every refusal uses. A temporary is named after the file it
replaces plus :data:`TEMPORARY_SUFFIX` (16 random hex digits, so nobody can plant one ahead of a
writer); stores written before that used ``<name>.tmp``.
"""

from __future__ import annotations

import errno
import re
import stat

#: How a temporary's name ends: 16 random hex digits and ``.tmp`` after the name of the file it replaces.
TEMPORARY_SUFFIX = r"\.[0-9a-f]{16}\.tmp"
TEMPORARY_NAME = re.compile(r"(?P<target>.+)" + TEMPORARY_SUFFIX, re.ASCII)
_LINK = "is a symbolic link; links are not followed"


def temporary_target(name: str) -> str | None:
    """The file a temporary named ``name`` would have replaced, or None when ``name`` is not a temporary's."""
    match = TEMPORARY_NAME.fullmatch(name)
    return None if match is None else match["target"]


def any_temporary_target(name: str) -> str | None:
    """:func:`temporary_target`, or for a temporary of a store written before it (``<name>.tmp``) ``<name>``."""
    return temporary_target(name) or (name.removesuffix(".tmp") if name.endswith(".tmp") else None)


def kind_of(mode: int) -> str:
    """``"file"``, ``"directory"``, ``"link"`` or ``"special"`` (FIFO, socket, device) for an ``st_mode``."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "link"
    return "special"


def not_regular(mode: int) -> str | None:
    """Why an entry of this mode is not read or written as a file, or None for a regular file."""
    kind = kind_of(mode)
    if kind == "file":
        return None
    if kind == "link":
        return _LINK
    if kind == "directory":
        return "is a directory, not a regular file"
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"is {what}, not a regular file; not read"


def os_problem(exc: OSError) -> str:
    """What an ``OSError`` from opening an entry says, in the words of :func:`not_regular`."""
    if isinstance(exc, FileNotFoundError):
        return "missing on disk"
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link put in place after the check
        return _LINK
    return f"cannot be read ({exc.strerror or exc}); check its permissions"
