"""Records decoded once while the reports are built (``core/store/reading/record_memo.py``): a second read inside
the block decodes nothing and gives what a fresh read gives; a shard changed on disk, or bytes a caller changed in
place, are decoded again; outside the block nothing is kept.

References are the gradients the test wrote (``hostilecases.build_store``) and reads with the memo off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hostilecases import build_store, check, of_shard, shard
from test_read_cache import _flip_last_byte

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.reading import batches, readcache
from metastore_plugins.core.store.reading.record_memo import RECORDS


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """``(shard name, record)`` of every record decoded, with empty caches to start."""
    found: list[tuple[str, int]] = []
    decode = batches.BatchRef.record_at

    def counted(self: batches.BatchRef, data: Any, k: int) -> Any:
        found.append((self.file.name, k))
        return decode(self, data, k)

    monkeypatch.setattr(batches.BatchRef, "record_at", counted)
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)  # a store keeps only the shard it just used
    readcache.SHARDS.clear()
    yield found
    readcache.SHARDS.clear()


def _tensors(store: Any) -> list[dict[str, torch.Tensor]]:
    return [dict(r.tensors) for batch in store.select().batches() for r in batch.records]


@pytest.mark.parametrize("encoding", ["fp32", "fp16"])
def test_inside_the_block_records_are_decoded_once_and_equal_a_fresh_read(
    tmp_path: Path, decoded: list, encoding: str
) -> None:
    expected = build_store(tmp_path / "store", encoding=encoding)
    fresh = _tensors(open_store(tmp_path / "store"))  # the memo off
    assert len(decoded) == len(fresh)
    decoded.clear()
    with RECORDS.active(1 << 30):
        store = open_store(tmp_path / "store")
        first, second = _tensors(store), _tensors(store)
        assert len(decoded) == len(fresh)  # the second read decoded nothing
        for got in (first, second):
            assert [sorted(t) for t in got] == [sorted(t) for t in fresh]
            assert all(torch.equal(a[key], b[key]) for a, b in zip(got, fresh) for key in a)
        if encoding == "fp32":
            check(store, expected)
    decoded.clear()
    _tensors(store), _tensors(store)
    assert len(decoded) == 2 * len(fresh)  # outside the block nothing is kept


def test_a_caller_changing_its_records_changes_no_later_read(tmp_path: Path, decoded: list) -> None:
    expected = build_store(tmp_path / "store")
    with RECORDS.active(1 << 30):
        store = open_store(tmp_path / "store")
        (batch,) = store.select(steps=1).batches()
        for record in batch.records:
            record.tensors.clear()  # its own dict, not the memo's
            record.params.clear()
        check(store, expected)


def test_a_shard_changed_on_disk_inside_the_block_is_read_and_decoded_again(tmp_path: Path, decoded: list) -> None:
    path = tmp_path / "store"
    expected = build_store(path)
    with RECORDS.active(1 << 30):
        store = open_store(path)
        check(store, expected)  # every record decoded and kept
        _flip_last_byte(shard(path, 1))
        with pytest.raises(StoreError, match=f"{shard(path, 1).name}: checksum mismatch"):
            store.restore(5)  # never the records decoded from the bytes before
        check(store, of_shard(expected, 2))


def test_bytes_a_caller_changed_in_place_are_decoded_again(tmp_path: Path, decoded: list) -> None:
    path = tmp_path / "store"
    expected = build_store(path)
    with RECORDS.active(1 << 30):
        store = open_store(path)
        (batch,) = store.select(steps=1).batches()  # shard 1, fp32: its tensors are views of the shard's bytes
        prefix = next(r.tensors["prefix"] for r in batch.records if "prefix" in r.tensors)
        prefix.mul_(0)  # a caller breaking the read-only contract
        check(store, of_shard(expected, 1))  # the shard read again, its records decoded again
    assert decoded.count((shard(path, 1).name, 0)) == 2


def test_the_allowance_keeps_the_most_recently_used_batches(tmp_path: Path, decoded: list) -> None:
    build_store(tmp_path / "store")
    store = open_store(tmp_path / "store")
    one = sum(r.nbytes for r in next(iter(store.select(steps=0).batches())).records)
    decoded.clear()
    with RECORDS.active(2 * one):  # two of the four batches
        for _ in range(2):
            for step in (0, 1, 2, 3):
                list(store.select(steps=step).batches())
        assert len(decoded) == 2 * len(batches_records(store))  # each pass evicts what the next needs
        decoded.clear()
        list(store.select(steps=3).batches())  # the most recent: kept
        assert decoded == []


def batches_records(store: Any) -> list[Any]:
    return [r for batch in store.select().batches() for r in batch.records]


def test_blocks_closed_out_of_order_leave_nothing_kept(tmp_path: Path, decoded: list) -> None:
    """Two threads' report passes overlapping (the first to open closes first): once both closed, a read keeps
    nothing."""
    build_store(tmp_path / "store")
    store = open_store(tmp_path / "store")
    first, second = RECORDS.active(1 << 30), RECORDS.active(1 << 20)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    list(store.select(steps=0).batches())
    second.__exit__(None, None, None)
    assert RECORDS.max_bytes == 0
    count = len(next(iter(store.select(steps=0).batches())).records)
    decoded.clear()
    list(store.select(steps=0).batches())
    list(store.select(steps=0).batches())
    assert len(decoded) == 2 * count  # decoded at each read: nothing kept
