"""The index of one rank as its writer keeps it: the manifest (config, layers) and the journal it appends to."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.file_kinds import any_temporary_target
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import MAX_SHARD_NUMBER, ShardEntry, shard_pattern
from metastore_plugins.core.store.shards.index import read_rank
from metastore_plugins.core.store.shards.journal import JournalAppender, RankLock, encode_line, journal_name


class RankIndexWriter:
    """Holds rank ``rank`` of a store for writing: its lock, manifest and journal.

    Opening continues an existing rank (a torn journal tail is cut off first: a reader ignores
    it anyway) or starts one; a version 1 rank is refused (it is read, never extended).
    Adding a shard costs one fsynced journal line, whatever the run's length; the manifest is
    rewritten only when the config or the layers change.
    """

    def __init__(self, directory: Path, rank: int, config: dict[str, Any]) -> None:
        self.directory, self.rank = directory, rank
        self.lock = RankLock(directory, rank)
        self.files = StoreDir(directory)
        try:
            self._open(config)
        except BaseException:
            self.files.close()
            self.lock.release()
            raise

    def _open(self, config: dict[str, Any]) -> None:
        for stale in self.files.listdir():  # a killed writer's temporaries of this rank (old names: name.tmp)
            target = any_temporary_target(stale)
            own = target in (mf.manifest_name(self.rank), journal_name(self.rank))
            if own or (target is not None and shard_pattern(self.rank).fullmatch(target)):
                self.files.remove(stale, missing_ok=True)
        path = self.directory / mf.manifest_name(self.rank)
        good_size, self.shards, self.samples = 0, 0, 0
        listed: list[str] = []
        if os.path.lexists(path):
            existing = read_rank(self.directory, self.rank, path)
            if existing.version < mf.JOURNAL_VERSION:
                raise StoreError(
                    f"{path} was written in format version {existing.version}; this writer appends to versions "
                    f"{mf.JOURNAL_VERSION}..{mf.SCHEMA_VERSION} only: write to a new store directory (the old store "
                    "stays readable)"
                )
            self.manifest = existing.manifest
            good_size = existing.good_size
            listed = [entry.file for entry in existing.entries]
            self.shards, self.samples = len(listed), sum(entry.rows for entry in existing.entries)
        else:
            self.manifest = mf.new_manifest(self.rank, {})
        merged = {**self.manifest.get("config", {}), **config}
        upgrade = self.manifest["schema_version"] != mf.SCHEMA_VERSION  # version 2: what it holds reads as 3
        if merged != self.manifest.get("config") or upgrade or not os.path.lexists(path):
            self.manifest["config"], self.manifest["schema_version"] = merged, mf.SCHEMA_VERSION
            mf.write_manifest(self.directory, self.manifest)
        self.journal = JournalAppender(self.files, journal_name(self.rank), good_size)
        self._lock = threading.Lock()
        self._changed = False  # layers or config changed since the manifest was written
        self._config_changed = False  # config changed since: written at close even without a new shard
        self.next_shard = first_free_shard(self.directory, self.rank, listed)

    @property
    def layers(self) -> dict[str, dict[str, Any]]:
        return self.manifest["layers"]

    def register_layers(self, new: dict[str, dict[str, Any]]) -> None:
        """Add layers; the manifest is rewritten before the next shard that uses them is listed."""
        with self._lock:
            self.manifest["layers"] = {**self.manifest["layers"], **new}
            self._changed = True

    def update_config(self, changes: dict[str, Any]) -> None:
        """Merge ``changes`` into the config; written with the next shard's listing, or at :meth:`close`."""
        with self._lock:
            self.manifest["config"] = {**self.manifest["config"], **changes}
            self._changed = self._config_changed = True

    def append(self, entry: ShardEntry) -> None:
        """List a shard that is whole on disk: manifest first if layers changed, then one journal line."""
        line = encode_line(entry.to_json())
        manifest = self._take_changed()
        try:
            if manifest is not None:
                mf.write_manifest(self.directory, manifest)
            self.files.fsync()  # the shard's rename first
            self.journal.append(line)
        except BaseException:
            with self._lock:
                self._changed = self._changed or manifest is not None
            raise
        self.shards += 1
        self.samples += entry.rows
        self.next_shard += 1

    def _take_changed(self) -> dict[str, Any] | None:
        """A copy of the manifest to write, when layers or config changed since it was last written."""
        with self._lock:
            changed, self._changed, self._config_changed = self._changed, False, False
            if not changed:
                return None
            return {**self.manifest, "layers": dict(self.manifest["layers"]), "config": dict(self.manifest["config"])}

    def save_config(self) -> None:
        """Write the manifest now when the config changed since it was written (layers alone are written with
        the shard that uses them)."""
        if self._config_changed:
            manifest = self._take_changed()
            if manifest is not None:
                mf.write_manifest(self.directory, manifest)

    def close(self) -> None:
        try:
            self.save_config()
        finally:
            self.journal.close()
            self.files.close()
            self.lock.release()


def first_free_shard(directory: Path, rank: int, listed: list[str]) -> int:
    """After the highest shard number of ``rank`` on disk or listed (a killed writer's file is never overwritten).

    Raises :class:`StoreError` naming the file when that number would not fit a shard name (a stray
    ``rank{r}-999999999.safetensors``): a shard under a name readers refuse would be lost.
    """
    pattern = shard_pattern(rank)
    on_disk = [any_temporary_target(n) or n for n in os.listdir(directory)]
    names = [*listed, *(n for n in on_disk if pattern.fullmatch(n))]
    highest = max(names, key=shard_number, default=None)
    if highest is not None and shard_number(highest) >= MAX_SHARD_NUMBER:
        raise StoreError(
            f"{directory / highest} takes the last shard number of rank {rank} ({MAX_SHARD_NUMBER}): no new shard "
            "name is left; if it is not a shard this store listed, move it out of the store directory"
        )
    return 0 if highest is None else shard_number(highest) + 1


def shard_number(name: str) -> int:
    """The number of a shard name ``rank{r}-{n}.safetensors``."""
    return int(name.split("-")[1].split(".")[0])
