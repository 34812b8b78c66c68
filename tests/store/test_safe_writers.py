"""The write side never writes, creates, truncates or locks a file outside the store (issue 29's probe cases).

Each case plants links inside a store, runs the writer, compaction, repair or the report
writers, and compares sha256 of the decoy files outside the store (and the outside folder's
listing) before and after. The old code wrote through every one of these links.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hostilecases import build_store, check, write_batches

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.reports import write_tables
from metastore_plugins.core.store.maintenance.compaction import compact, repair
from metastore_plugins.core.store.vectors import sketch_cache

LINKS = ["to_file", "dangling"]


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (links not followed), by relative path."""
    found = {}
    for path in sorted(folder.rglob("*")):
        regular = path.is_file() and not path.is_symlink()
        found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest() if regular else "other"
    return found


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder of decoys beside the store: ``decoy.txt`` and ``folder/inner.txt``."""
    folder = tmp_path / "outside"
    (folder / "folder").mkdir(parents=True)
    (folder / "decoy.txt").write_bytes(b'{"decoy": "must never change"}\n')
    (folder / "folder" / "inner.txt").write_bytes(b"inner decoy\n")
    return folder


def _link(at: Path, outside: Path, how: str) -> None:
    at.symlink_to(outside / ("decoy.txt" if how == "to_file" else "created.txt"))


@pytest.mark.parametrize("how", [*LINKS, "fifo", "directory"])
def test_a_writer_never_truncates_or_appends_through_a_linked_journal(tmp_path: Path, outside: Path, how: str) -> None:
    store = tmp_path / "store"
    store.mkdir()
    journal = store / "index-rank0.jsonl"
    if how == "fifo":
        os.mkfifo(journal)
    elif how == "directory":
        journal.mkdir()
    else:
        _link(journal, outside, how)
    before = _digests(outside)
    with pytest.raises(StoreError, match=r"index-rank0\.jsonl: is a (symbolic link|FIFO|directory).*remove it"):
        StoreWriter(store, encoding="fp32")
    assert _digests(outside) == before
    assert journal.is_symlink() or journal.is_fifo() or journal.is_dir()


def _resume(store: Path) -> None:
    with StoreWriter(store, encoding="fp32", shard_bytes=1) as writer:
        write_batches(writer, range(4, 5))


LOCK_TAKERS: dict[str, Callable[[Path], Any]] = {"writer": _resume, "compact": compact, "repair": repair}


@pytest.mark.parametrize("taker", sorted(LOCK_TAKERS))
@pytest.mark.parametrize("how", [*LINKS, "directory"])
def test_a_linked_or_directory_lock_is_refused_and_nothing_outside_is_created_or_locked(
    tmp_path: Path, outside: Path, how: str, taker: str
) -> None:
    store = tmp_path / "store"
    expected = build_store(store)
    lock = store / "rank0.lock"
    lock.unlink()
    if how == "directory":
        lock.mkdir()
    else:
        _link(lock, outside, how)
    inside, before = _digests(store), _digests(outside)
    with pytest.raises(StoreError, match=r"rank0\.lock: is a (symbolic link|directory)"):
        LOCK_TAKERS[taker](store)
    assert _digests(outside) == before
    assert _digests(store) == inside  # refused before anything was changed
    check(open_store(store), expected)  # every sample still reads as written


def _tiny_store(tmp_path: Path) -> Any:
    path = tmp_path / "store"
    build_store(path, shards=1)
    return open_store(path)


def _tables() -> dict[str, Any]:
    columns = ["rank", "sample_id", "label", "loss"]
    outliers = [
        {"rank": 1, "sample_id": 3, "label": 0, "loss": 2.5},
        {"rank": 2, "sample_id": 1, "label": 1, "loss": 1.5},
    ]
    influence = [
        {
            "test_id": 0,
            "test_label": 1,
            "test_prediction": 1,
            "proponents": [{"sample_id": 3, "label": 1, "score": 0.5}],
            "opponents": [{"sample_id": 1, "label": 0, "score": -0.5}],
        }
    ]
    return {"outliers": outliers, "outlier_columns": columns, "influence": influence}


def test_report_files_replace_links_instead_of_writing_through_them(tmp_path: Path, outside: Path) -> None:
    store = _tiny_store(tmp_path)
    reports = store.path / "reports"
    reports.mkdir()
    names = ["outliers.json", "outliers.csv", "outliers.md", "influence.json", "influence.md", "summary.json"]
    for name in names:
        (reports / name).symlink_to(outside / "decoy.txt")
    before = _digests(outside)
    result = write_tables(store, reports, _tables())
    assert sorted(Path(p).name for p in result["files"]) == sorted(names)
    assert _digests(outside) == before
    for name in names:
        assert not (reports / name).is_symlink()
    assert json.loads((reports / "outliers.json").read_text()) == _tables()["outliers"]


def test_reports_never_go_into_a_reports_folder_that_links_outside(tmp_path: Path, outside: Path) -> None:
    store = _tiny_store(tmp_path)
    (store.path / "reports").symlink_to(outside / "folder", target_is_directory=True)
    before = _digests(outside)
    with pytest.raises(StoreError, match=r"reports: is a symbolic link.*remove the link"):
        write_tables(store, store.path / "reports", _tables())
    assert _digests(outside) == before


def test_a_figure_replaces_a_link_instead_of_writing_through_it(tmp_path: Path, outside: Path) -> None:
    pytest.importorskip("matplotlib")
    from metastore_plugins.core.reports.render import save_png, scatter_figure

    reports = tmp_path / "store" / "reports"
    reports.mkdir(parents=True)
    (reports / "loss_vs_self_influence.png").symlink_to(outside / "decoy.txt")
    before = _digests(outside)
    table = {
        "sample_id": torch.arange(4).numpy(),
        "self_influence": torch.tensor([1.0, 2.0, 3.0, 4.0]).numpy(),
        "label": torch.tensor([0, 1, 0, 1]).numpy(),
        "loss": torch.tensor([0.5, 1.0, 1.5, 2.0]).numpy(),
    }
    save_png(scatter_figure(table), reports / "loss_vs_self_influence.png")
    assert _digests(outside) == before
    written = reports / "loss_vs_self_influence.png"
    assert not written.is_symlink() and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sketch_cache_never_reads_or_writes_through_links(tmp_path: Path, outside: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    key = sketch_cache.SketchKey("train", 2, 0, ("fc",), "b" * 64, 3)
    ids, sketch = torch.arange(3).numpy(), torch.ones(3, 4)  # (N,), (N, dim^2)
    (store / sketch_cache.CACHE_DIR).symlink_to(outside / "folder", target_is_directory=True)
    before = _digests(outside)
    assert sketch_cache.save(store, key, ids, sketch) is None  # computed in memory instead
    assert sketch_cache.load(store, key) is None
    (store / sketch_cache.CACHE_DIR).unlink()
    (store / sketch_cache.CACHE_DIR).mkdir()
    (store / sketch_cache.CACHE_DIR / key.file_name()).symlink_to(outside / "decoy.txt")
    assert sketch_cache.load(store, key) is None
    assert sketch_cache.save(store, key, ids, sketch) == sketch_cache.cache_path(store, key)
    assert _digests(outside) == before
    loaded = sketch_cache.load(store, key)
    assert loaded is not None and loaded[0].tolist() == [0, 1, 2]
