"""A callback's report pass keeps the read cache within ``REPORT_CACHE_BYTES`` and leaves it empty.

Reference: the same reports built with the process's default allowance (every shard kept), which must give the
same influence rows; the bytes held are observed after every shard the cache keeps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from methodcases import write_passes

from metastore_plugins.core.store.reading import batches, readcache
from metastore_plugins.core.training import report_pass
from metastore_plugins.core.training.settings import CallbackOptions


def test_reports_hold_at_most_their_allowance_and_leave_the_cache_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = CallbackOptions.of("MetaStoreCallback", {})
    reference_dir = write_passes(tmp_path / "reference")
    readcache.SHARDS.clear()
    report_pass.build_reports(options, reference_dir, [], step=0)
    expected = json.loads((reference_dir / "reports" / "influence.json").read_text())

    store_dir = write_passes(tmp_path / "store")
    shards = sorted(store_dir.rglob("*.safetensors"))
    allowance = min(path.stat().st_size for path in shards) - 1  # below a shard: nothing kept
    monkeypatch.setattr(report_pass, "REPORT_CACHE_BYTES", allowance)
    held, keep = [], readcache.ShardCache._keep

    def observed(cache: readcache.ShardCache, identity: Any, kept: Any) -> None:
        keep(cache, identity, kept)
        held.append(cache.nbytes)

    monkeypatch.setattr(readcache.ShardCache, "_keep", observed)
    before = readcache.SHARDS.max_bytes
    result = report_pass.build_reports(options, store_dir, [], step=0)
    assert result is not None and json.loads((store_dir / "reports" / "influence.json").read_text()) == expected
    assert held and max(held) <= allowance  # the default allowance would keep the shard: its size
    assert readcache.SHARDS.max_bytes == before and readcache.SHARDS.nbytes == 0


def test_reports_read_each_shard_once_within_their_allowance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every query of a report pass (self-influence, influence, outliers, norms) reads a shard from disk once while
    the store fits the allowance; with none, each query reads it again, and the tables are the same."""
    options = CallbackOptions.of("MetaStoreCallback", {})
    reads: list[str] = []
    read = readcache.read_opened
    monkeypatch.setattr(readcache, "read_opened", lambda *args: reads.append(args[2].name) or read(*args))
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)  # a store keeps only the shard it just used open

    def reports(directory: Path) -> tuple[dict[str, int], list[Any]]:
        reads.clear()
        readcache.SHARDS.clear()
        report_pass.build_reports(options, directory, [], step=0)
        counts = {name: reads.count(name) for name in set(reads)}
        names = ("influence", "outliers")
        return counts, [json.loads((directory / "reports" / f"{name}.json").read_text()) for name in names]

    once, tables = reports(write_passes(tmp_path / "cached", shards=True))
    assert len(once) == 4 and set(once.values()) == {1}, once
    monkeypatch.setattr(report_pass, "REPORT_CACHE_BYTES", 0)  # nothing kept: every query reads for itself
    again, uncached = reports(write_passes(tmp_path / "uncached", shards=True))
    assert max(again.values()) > 1 and uncached == tables
