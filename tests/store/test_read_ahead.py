"""Shards read ahead on a background thread while the caller computes (``core/store/reading/selection.py``, issue 35).

The scores are compared with an explicit dense matmul of the gradients the test wrote (``hostilecases``,
by einsum); the read ahead must change nothing the safe read path promises: the bytes used are the bytes
checked, a file changed after it was read ahead is read and checked again, a damaged shard is refused
with the message it always had, and no thread outlives the scan.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostilecases import build_store, check, of_shard, shard

from metastore_plugins import open_store
from metastore_plugins.core.analysis.queries import dot_matrix
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.reading import batches, readcache, selection

SHARDS = 6


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """``(shard name, thread name)`` of every shard read from disk, with an empty cache to start."""
    seen: list[tuple[str, str]] = []
    read = readcache.read_opened  # (fd, opened, file, expect)
    note = lambda *args: seen.append((args[2].name, threading.current_thread().name)) or read(*args)  # noqa: E731
    monkeypatch.setattr(readcache, "read_opened", note)
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)  # a store keeps only the shard it just used
    monkeypatch.setattr(selection, "READ_AHEAD", 4)  # off by default (see its comment): on here
    readcache.SHARDS.clear()
    yield seen
    readcache.SHARDS.clear()


def _ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("metastore-read-ahead")]


def _flat(expected: dict[int, dict[str, torch.Tensor]], ids: np.ndarray) -> torch.Tensor:
    """``(N, P)`` the written gradients (float64) of samples ``ids``, flattened."""
    return torch.stack(
        [torch.cat([expected[int(i)][k].double().flatten() for k in sorted(expected[int(i)])]) for i in ids]
    )


def _reference(expected: dict[int, dict[str, torch.Tensor]], ids: np.ndarray) -> np.ndarray:
    """``(N, N)`` Gram matrix of the written gradients (float64), rows in ``ids`` order."""
    flat = _flat(expected, ids)  # (N, P)
    return (flat @ flat.T).numpy()


def test_scores_read_ahead_match_a_dense_matmul_and_each_shard_is_read_once(
    tmp_path: Path, reads: list[tuple[str, str]]
) -> None:
    path = tmp_path / "store"
    expected = build_store(path, shards=SHARDS)
    store = open_store(path)
    rows = store.select()
    found = dot_matrix(rows, rows)  # (N, N)
    reference = _reference(expected, rows.sample_ids())
    np.testing.assert_allclose(found, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    names = [name for name, _ in reads]
    assert sorted(names) == sorted({name for name in names}) == [shard(path, i).name for i in range(SHARDS)]
    assert any(thread.startswith("metastore-read-ahead") for _, thread in reads)  # read ahead, not by the caller
    assert _ahead_threads() == []


def test_no_read_ahead_beyond_the_cache_allowance(
    tmp_path: Path, reads: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    expected = build_store(path, shards=SHARDS)
    monkeypatch.setenv(readcache.ENV_VAR, "0")  # no cache: a shard read ahead would be read twice
    rows = open_store(path).select()
    np.testing.assert_allclose(dot_matrix(rows, rows), _reference(expected, rows.sample_ids()), rtol=1e-5, atol=1e-4)
    assert all(not thread.startswith("metastore-read-ahead") for _, thread in reads)


def test_a_scan_left_early_leaves_no_thread(tmp_path: Path, reads: list[tuple[str, str]]) -> None:
    path = tmp_path / "store"
    build_store(path, shards=SHARDS)
    scan = open_store(path).select().batches()
    next(scan)  # the next shards are being read ahead
    scan.close()
    assert _ahead_threads() == []


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_damaged_shard_is_refused_with_the_message_it_had(
    tmp_path: Path, reads: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch, ahead: int
) -> None:
    path = tmp_path / "store"
    expected = build_store(path, shards=SHARDS)
    with open(shard(path, 3), "r+b") as handle:  # one bit of the last tensor flipped
        handle.seek(-1, 2)
        byte = handle.read(1)[0]
        handle.seek(-1, 2)
        handle.write(bytes([byte ^ 1]))
    monkeypatch.setattr(selection, "READ_AHEAD", ahead)
    rows = open_store(path).select()
    with pytest.raises(StoreError) as caught:
        dot_matrix(rows, rows)
    assert str(caught.value) == (
        f"{shard(path, 3)}: checksum mismatch, xxh3_128 "
        f"{str(caught.value).split('xxh3_128 ')[1].split(' ')[0]} on disk but "
        f"{open_store(path).index.shards[3].xxh3_128} in the index (the file is damaged); "
        "other shards stay readable, store.verify() lists all damage"
    )
    assert _ahead_threads() == []
    check(open_store(path), of_shard(expected, 4))


def test_a_shard_replaced_after_it_was_read_ahead_is_read_and_checked_again(
    tmp_path: Path, reads: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    build_store(path, shards=SHARDS)
    read = selection.ReadAhead._read

    def then_replaced(self: selection.ReadAhead, index: int) -> Any:
        data = read(self, index)
        if index == 2:  # another valid shard of the same size, after the read ahead checked the first
            replacement = tmp_path / "replacement"  # renamed over it: never seen half written (0 bytes)
            replacement.write_bytes(shard(path, 1).read_bytes())
            os.replace(replacement, shard(path, 2))
        return data

    monkeypatch.setattr(selection.ReadAhead, "_read", then_replaced)
    rows = open_store(path).select()
    with pytest.raises(StoreError, match=f"{shard(path, 2).name}: checksum mismatch"):
        dot_matrix(rows, rows)  # never shard 2's bytes read ahead, never shard 1's under its name
    threads = [thread for name, thread in reads if name == shard(path, 2).name]  # read ahead, then by the caller
    assert any(t.startswith("metastore-read-ahead") for t in threads), threads
    assert any(not t.startswith("metastore-read-ahead") for t in threads), threads  # the caller read and checked it
    assert _ahead_threads() == []


def test_the_rows_first_shards_are_read_ahead_while_the_columns_are_read(
    tmp_path: Path, reads: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    expected = build_store(path, shards=SHARDS)  # shard i holds samples 4i..4i+3
    row_read = threading.Event()
    read = readcache.read_opened  # the fixture's: notes each read

    def columns_wait(fd: int, opened: Any, file: Path, expect: Any) -> Any:
        if file == shard(path, 0):  # a column shard: read only once the rows' first shard was (10 s at most)
            row_read.wait(10)
        data = read(fd, opened, file, expect)
        if file == shard(path, 2):
            row_read.set()
        return data

    monkeypatch.setattr(readcache, "read_opened", columns_wait)
    store = open_store(path)
    rows, cols = store.select(sample_ids=list(range(8, 24))), store.select(sample_ids=list(range(8)))
    found = dot_matrix(rows, cols)  # (16, 8)
    reference = (_flat(expected, rows.sample_ids()) @ _flat(expected, cols.sample_ids()).T).numpy()  # (16, 8)
    np.testing.assert_allclose(found, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    threads = dict(reads)
    assert threads[shard(path, 2).name].startswith("metastore-read-ahead")  # before the columns were read
    assert sorted(threads) == sorted(name for name, _ in reads)  # every shard read once
    assert _ahead_threads() == []
