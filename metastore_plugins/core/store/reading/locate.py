"""Where a run keeps its store: :func:`find_store_dir` (a store, run, Lightning log or HF output directory all
open the same way) and, for a directory that holds none, the stores below it (:func:`stores_below`, a hint)."""

from __future__ import annotations

import os
from pathlib import Path

from metastore_plugins.core.store.shards import manifest as mf

#: Subdirectories where a run keeps its store: the examples' ``store/``, the callbacks' ``metastore/``
#: (``<trainer.log_dir>/metastore``, ``<args.output_dir>/metastore``).
STORE_SUBDIRS = ("store", "metastore")


def find_store_dir(path: str | os.PathLike[str]) -> Path:
    """The store directory of ``path``: itself, or the first of its :data:`STORE_SUBDIRS` that holds manifests.

    So a store directory, an example's run directory, a Lightning log directory
    (``lightning_logs/version_0``) and a Hugging Face ``output_dir`` all open the same way.
    ``path`` itself when none holds manifests (opening it then says what is missing).
    """
    path = Path(path)
    if mf.find_manifests(path):
        return path
    return next((path / sub for sub in STORE_SUBDIRS if mf.find_manifests(path / sub)), path)


def stores_below(path: Path, depth: int = 3) -> list[Path]:
    """Store directories at most ``depth`` levels below ``path`` (for a hint), in name order."""
    found: set[Path] = set()
    for level in range(1, depth + 1):
        try:
            found.update(m.parent for m in path.glob("/".join(["*"] * level) + "/manifest-rank*.json"))
        except OSError:
            break
    return sorted(found)[:5]
