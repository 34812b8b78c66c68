"""Compaction writes only lines its reader accepts and deletes nothing before the new journal reads back whole
(issue 29): merges split at the line-size and name-count caps, a stray last shard number refused, lines the reader
cannot use kept byte for byte, a planted temporary link never written through. Samples are compared with the sample
ids the store's own shard files hold, read with safetensors; every file inside and outside the store is hashed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hostilecases import build_store, column, edit_line, journal
from maintenancecases import bulk_store, changed, shard_ids, tree

from metastore_plugins import open_store
from metastore_plugins.core.store.maintenance import compaction as maintenance
from metastore_plugins.core.store.maintenance.compaction import compact
from metastore_plugins.core.store.shards import journal as journal_module
from metastore_plugins.core.store.shards.entries import MAX_NAMES


def _ids_on_disk(path: Path) -> list[int]:
    """Every sample id the store's shard files hold (journal order does not matter here)."""
    return sorted(i for p in path.glob("*.safetensors") for i in shard_ids(p))


def _line_lengths(path: Path) -> list[int]:
    return [len(line) for line in journal(path).read_bytes().splitlines(keepends=True)]


def test_a_merge_whose_line_would_pass_the_line_cap_is_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: 8.6 M samples merged into one 275 MB line, over the reader's 256 MiB: the store then opened empty.
    The same at a sixteenth of the cap: 10^5 samples, about 2.6 MB of journal, a 1 MiB cap."""
    path = tmp_path / "store"
    ids = bulk_store(path, shards=40, batches=25, size=100)
    monkeypatch.setattr(journal_module, "MAX_LINE_BYTES", 2**20)  # the reader's cap, as journal.read_lines reads it
    assert sum(_line_lengths(path)) > 2 * 2**20 and max(_line_lengths(path)) < 2**20 // 8
    report = compact(path, target_bytes=1 << 30)
    assert len(report.written) >= 3 and report.skipped == []
    assert max(_line_lengths(path)) <= 2**20
    store = open_store(path)
    assert store.verify() == []
    np.testing.assert_array_equal(np.sort(store.sample_ids()), ids)
    assert _ids_on_disk(path) == ids.tolist()


def test_a_merge_that_would_list_too_many_capture_points_is_split(tmp_path: Path) -> None:
    """Issue 29: a line with 65,540 capture-point names (over 2^16) made the rank open empty."""
    path = tmp_path / "store"
    ids = bulk_store(path, shards=4, batches=20_000, size=1, distinct_points=True, ids_only=True)
    assert 4 * 20_000 > MAX_NAMES
    report = compact(path, target_bytes=1 << 30)
    assert report.skipped == [] and len(report.written) == 2  # two lines of 40,000 names each
    store = open_store(path)
    assert store.verify() == []
    np.testing.assert_array_equal(np.sort(store.sample_ids()), ids)
    assert len(store.capture_points()) == 80_000


def test_a_stray_last_shard_number_is_refused(tmp_path: Path) -> None:
    """Issue 29: a stray rank0-999999999.safetensors made the next shard rank0-1000000000, a name readers refuse."""
    path = tmp_path / "store"
    ids = bulk_store(path, shards=4, batches=2, size=3)
    (path / "rank0-999999999.safetensors").write_bytes(b"not ours")
    before = tree(tmp_path)
    report = compact(path)
    assert report.written == [] and report.merged == []
    assert report.skipped == [
        f"rank 0: not compacted: {path / 'rank0-999999999.safetensors'} takes the last shard number of rank 0 "
        "(999999999): no new shard name is left; if it is not a shard this store listed, move it out of the store "
        "directory"
    ]
    assert changed(before, tree(tmp_path)) == set()
    np.testing.assert_array_equal(np.sort(open_store(path).sample_ids()), ids)


def test_lines_the_reader_cannot_use_are_kept_byte_for_byte(tmp_path: Path) -> None:
    """Issue 29: compaction dropped a line with an unknown, future additive column (and any other ignored line)."""
    path = tmp_path / "store"
    build_store(path, shards=6)
    edit_line(path, 2, lambda entry: entry["samples"].update(weight=column([0.5] * 4, "f4")))
    future = journal(path).read_bytes().splitlines(keepends=True)[2]
    ids = _ids_on_disk(path)
    report = compact(path)
    assert report.merged == [f"rank0-00000{i}.safetensors" for i in (0, 1, 3, 4, 5)]
    lines = journal(path).read_bytes().splitlines(keepends=True)
    assert lines[1] == future and len(lines) == 2  # after the merged line, which took the place of the first
    assert (path / "rank0-000002.safetensors").exists()
    assert _ids_on_disk(path) == ids
    store = open_store(path)
    assert sorted(store.sample_ids().tolist()) == [i for i in ids if i // 4 != 2]  # as before: this version skips it


def test_a_new_journal_that_does_not_read_back_whole_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal is read back with the reader before any original is removed; a short one is put back."""
    path = tmp_path / "store"
    ids = bulk_store(path, shards=6, batches=2, size=3)
    real = maintenance.rewrite
    calls = []

    def short(target: Path, lines: list[bytes]) -> None:  # a first write that loses its last line
        calls.append(len(lines))
        real(target, lines[:-1] if len(calls) == 1 else lines)

    monkeypatch.setattr(maintenance, "rewrite", short)
    before = tree(tmp_path)
    report = compact(path)
    assert report.written == [] and report.skipped[-1].endswith("the new journal did not read back whole; as it was")
    assert changed(before, tree(tmp_path)) == set()  # the journal put back byte for byte, the new shard removed
    np.testing.assert_array_equal(np.sort(open_store(path).sample_ids()), ids)


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_planted_temporary_link_is_never_written_through(tmp_path: Path, dangling: bool) -> None:
    """Issue 29: compaction wrote the journal through a planted index-rank0.jsonl.tmp link (or created its target)."""
    path = tmp_path / "store"
    ids = bulk_store(path, shards=6, batches=2, size=3)
    target = tmp_path / "outside.jsonl"
    if not dangling:
        target.write_text("someone else's file")
    os.symlink(target, path / "index-rank0.jsonl.tmp")
    outside = {k: v for k, v in tree(tmp_path).items() if not k.startswith("store/")}
    report = compact(path)
    assert len(report.written) == 1
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("store/")} == outside
    assert os.path.islink(path / "index-rank0.jsonl.tmp") and not os.path.islink(journal(path))
    np.testing.assert_array_equal(np.sort(open_store(path).sample_ids()), ids)


def test_a_million_sample_store_compacts_with_every_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29's 10^7-sample store at a tenth of the size and a sixteenth of the line cap (10^6 samples, about
    27 MB of journal against 16 MiB), so that one merged line would pass the cap as 10^7 passes 256 MiB; the
    10^7 run itself: ``python -m metastore_bench.compaction_scale``."""
    path = tmp_path / "store"
    ids = bulk_store(path, shards=100, batches=100, size=100)
    monkeypatch.setattr(journal_module, "MAX_LINE_BYTES", 16 * 2**20)
    report = compact(path, target_bytes=256 * 2**20)
    assert len(report.merged) == 100 and len(report.written) >= 2 and report.skipped == []
    store = open_store(path)
    np.testing.assert_array_equal(np.sort(store.sample_ids()), ids)
    assert store.summary()["samples"] == 10**6
