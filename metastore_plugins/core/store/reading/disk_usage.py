"""The bytes a store directory holds on disk, by part: what ``summary()`` and ``metastore inspect`` count.

Every regular file below the store directory is counted once by its size (``lstat``), links are neither
counted nor followed, and a folder that cannot be listed is left out. The parts (docs/format.md#files):

- ``shards``: the shard files the index lists;
- ``snapshots``: the weight snapshots (``snapshots/``);
- ``index``: the other files of the store's record (manifests, journals, tags, snapshot journals, run
  logs, locks);
- ``caches``: what queries keep and can rebuild (``sketches/``, ``vector_index/``, ``tag_cache/``);
- ``reports``: the report files (``reports/``);
- ``other``: anything else (unlisted shards, temporaries, ``quarantine/``, folders of the user's).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection
from pathlib import Path

from metastore_plugins.core.store.file_kinds import any_temporary_target
from metastore_plugins.core.store.snapshots.weights import DIRECTORY as SNAPSHOTS_DIR
from metastore_plugins.core.store.tags.tag_cache import FOLDER as TAG_CACHE_DIR
from metastore_plugins.core.store.vectors.sketch_cache import CACHE_DIR
from metastore_plugins.core.store.vectors.vector_files import FOLDER as INDEX_DIR

#: The parts of :func:`disk_usage`, in the order they are shown.
PARTS = ("shards", "snapshots", "index", "caches", "reports", "other")
#: The folders of a store directory and the part each one's files count in.
FOLDERS = {
    SNAPSHOTS_DIR: "snapshots",
    CACHE_DIR: "caches",
    INDEX_DIR: "caches",
    TAG_CACHE_DIR: "caches",
    "reports": "reports",
}
#: Files of the store's record beside the shards (docs/format.md#files).
_RECORD_FILE = re.compile(r"(manifest-rank\d+\.json|(index|snapshots|tags|run)-rank\d+\.jsonl|rank\d+\.lock)", re.ASCII)


def disk_usage(directory: Path, listed: Collection[str]) -> dict[str, int]:
    """Bytes of the regular files below ``directory`` per part of :data:`PARTS` (``listed``: the listed shards)."""
    usage = dict.fromkeys(PARTS, 0)
    root = os.path.realpath(directory)  # the store root may be a user's link; nothing below it is followed
    for top, _, files, top_fd in os.fwalk(root, follow_symlinks=False):
        below = Path(os.path.relpath(top, root)).parts
        for name in files:
            try:
                found = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            except OSError:  # removed meanwhile
                continue
            if stat.S_ISREG(found.st_mode):
                usage[_part(below, name, listed)] += found.st_size
    return usage


def _part(below: tuple[str, ...], name: str, listed: Collection[str]) -> str:
    """The part of the file ``name`` in the folder ``below`` (relative to the store directory; ``()``: the store)."""
    if below:
        return FOLDERS.get(below[0], "other")
    if name in listed:
        return "shards"
    return "index" if _RECORD_FILE.fullmatch(name) and any_temporary_target(name) is None else "other"
