"""The process's cache of checked shards (``core/store/reading/readcache.py``): reused unread while a file's identity
holds, read and checked again when it changes, never serving bytes that differ from the ones checked.

References are the gradients the test wrote (``hostilecases.build_store``), restored through a fresh,
uncached read where it matters.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hostilecases import build_store, check, of_shard, shard

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.reading import batches, readcache
from metastore_plugins.core.store.shards.shardread import ShardExpectation, expected_keys


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of the shards read from disk (not served from memory), with an empty cache to start."""
    names: list[str] = []
    read = readcache.read_opened

    def counted(fd: int, opened: Any, file: Path, expect: Any) -> Any:
        names.append(file.name)
        return read(fd, opened, file, expect)

    monkeypatch.setattr(readcache, "read_opened", counted)
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)  # a store keeps only the shard it just used
    readcache.SHARDS.clear()
    yield names
    readcache.SHARDS.clear()


def _flip_last_byte(file: Path) -> None:
    """One bit of the last tensor's bytes flipped in place (same inode, same size)."""
    with open(file, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte ^ 1]))


def test_a_second_store_on_the_same_files_reads_nothing(tmp_path: Path, reads: list[str]) -> None:
    expected = build_store(tmp_path / "store")
    check(open_store(tmp_path / "store"), expected)
    assert sorted(reads) == [shard(tmp_path / "store", i).name for i in range(4)]
    check(open_store(tmp_path / "store"), expected)  # influence, then self-influence: the same bytes, unread
    assert len(reads) == 4


@pytest.mark.parametrize("mtime", ["changed", "set back"])
def test_a_bit_flipped_after_the_first_read_of_a_cached_shard_is_caught(
    tmp_path: Path, reads: list[str], mtime: str
) -> None:
    path = tmp_path / "store"
    expected = build_store(path)
    store = open_store(path)
    check(store, expected)  # every shard read, checked and cached
    victim = shard(path, 1)
    before = victim.stat()
    _flip_last_byte(victim)
    # a tool that keeps timestamps sets the mtime back; the ctime still moves
    when = before.st_mtime_ns + 10**9 if mtime == "changed" else before.st_mtime_ns
    os.utime(victim, ns=(before.st_atime_ns, when))
    assert victim.stat().st_size == before.st_size and victim.stat().st_ino == before.st_ino
    for reader in (store, open_store(path)):  # the store that cached it, and a new one
        with pytest.raises(StoreError, match=f"{victim.name}: checksum mismatch"):
            reader.restore(5)  # never the cached bytes of a file that changed
        check(reader, of_shard(expected, 2))
    assert reads.count(victim.name) == 3  # the first read, then once per refusal


def test_bytes_changed_in_place_by_a_caller_are_read_again(tmp_path: Path, reads: list[str]) -> None:
    path = tmp_path / "store"
    expected = build_store(path)
    store = open_store(path)
    (batch,) = store.select(steps=1).batches()  # shard 1
    prefix = next(r.tensors["prefix"] for r in batch.records if "prefix" in r.tensors)
    prefix.mul_(0)  # a caller breaking the read-only contract of the tensors it was lent
    check(store, of_shard(expected, 1))  # not served changed: read and checked again
    check(open_store(path), of_shard(expected, 1))
    assert reads.count(shard(path, 1).name) == 2


def test_bytes_read_unchecked_are_checked_in_memory_when_a_check_is_asked(tmp_path: Path, reads: list[str]) -> None:
    path = tmp_path / "store"
    expected = build_store(path)
    _flip_last_byte(shard(path, 1))  # damaged before any read: its size and keys are intact
    open_store(path, checksums=False).restore(5)  # not checked, by request
    with pytest.raises(StoreError, match=f"{shard(path, 1).name}: checksum mismatch"):
        open_store(path).restore(5)
    assert reads.count(shard(path, 1).name) == 1  # the check ran on the bytes kept, not a second read
    check(open_store(path), of_shard(expected, 2))


def test_the_allowance_keeps_the_most_recently_used_shards(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build_store(path)
    store = open_store(path)
    sizes = [shard(path, i).stat().st_size for i in range(4)]
    cache = readcache.ShardCache(max_bytes=sizes[0] + sizes[1])
    expect = [store.index.expectation(i, True, fast=True) for i in range(4)]
    for i in (0, 1, 2, 1):
        cache.read(shard(path, i), path, expect[i])
    assert cache.reads == 3 and cache.nbytes == sizes[1] + sizes[2]  # shard 0 dropped first
    cache.read(shard(path, 0), path, expect[0])
    assert cache.reads == 4 and cache.nbytes == sizes[1] + sizes[0]  # then shard 2, the least recently used
    small = readcache.ShardCache(max_bytes=sizes[0] - 1)
    small.read(shard(path, 0), path, expect[0])
    assert small.nbytes == 0  # larger than the allowance: read, not kept


def test_within_a_smaller_allowance_the_cache_holds_less_and_is_emptied_after(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build_store(path)
    store = open_store(path)
    sizes = [shard(path, i).stat().st_size for i in range(4)]
    cache = readcache.ShardCache(max_bytes=1 << 30)
    expect = [store.index.expectation(i, True, fast=True) for i in range(4)]
    cache.read(shard(path, 3), path, expect[3])
    with cache.within(sizes[0] + sizes[1]):
        assert cache.limit() == sizes[0] + sizes[1]
        for i in (0, 1, 2):
            cache.read(shard(path, i), path, expect[i])
            assert cache.nbytes <= sizes[0] + sizes[1]
        assert cache.nbytes == sizes[1] + sizes[2]  # the most recently used that fit
    assert cache.limit() == 1 << 30 and cache.nbytes == 0  # the earlier allowance back, nothing kept
    with cache.within(1 << 40):  # never more than the allowance already was
        assert cache.limit() == 1 << 30


def test_other_expected_keys_parse_the_kept_bytes_again(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build_store(path)
    store = open_store(path)
    cache = readcache.ShardCache(max_bytes=1 << 30)
    expect = store.index.expectation(0, True)
    data = cache.read(shard(path, 0), path, expect)
    required, _ = expected_keys([((), [])], "fp32")  # a shard said to hold only b0/meta/sample_id
    wrong = ShardExpectation(expect.bytes, expect.sha256, required, frozenset(), expect.xxh3_128)
    with pytest.raises(StoreError, match="holds .* tensor key\\(s\\) the index does not list"):
        cache.read(shard(path, 0), path, wrong)
    assert cache.read(shard(path, 0), path, expect) is data and cache.reads == 1


def test_the_allowance_is_a_quarter_of_memory_up_to_4_gib_or_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(readcache.ENV_VAR, raising=False)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert readcache.allowance() == min(memory // 4, 4 * 2**30)
    monkeypatch.setenv(readcache.ENV_VAR, "0")
    assert readcache.allowance() == 0
    monkeypatch.setenv(readcache.ENV_VAR, "123456")
    assert readcache.allowance() == 123456
    monkeypatch.setenv(readcache.ENV_VAR, "2GiB")
    with pytest.raises(ValueError, match=f"{readcache.ENV_VAR}='2GiB' is not a number of bytes"):
        readcache.allowance()


@pytest.mark.parametrize("first", ["succeeds", "fails"])
def test_a_shard_another_thread_is_reading_is_waited_for_not_read_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    path = tmp_path / "store"
    build_store(path)
    expect = open_store(path).index.expectation(0, True, fast=True)
    cache = readcache.ShardCache(max_bytes=1 << 30)
    waiting, calls = threading.Event(), []
    read, read_once = readcache.read_opened, cache._read_once

    def slow(fd: int, opened: Any, file: Path, expect: Any) -> Any:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:  # the first read holds on until the other thread waits for it (10 s at most)
            waiting.wait(10)
            if first == "fails":
                raise StoreError(f"{file}: cannot be read (a failure of this read only)")
        return read(fd, opened, file, expect)

    def noted(*args: Any) -> Any:
        found = read_once(*args)
        if isinstance(found, threading.Event):
            waiting.set()
        return found

    monkeypatch.setattr(readcache, "read_opened", slow)
    monkeypatch.setattr(cache, "_read_once", noted)
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(cache.read, shard(path, 0), path, expect)
        while not calls:
            time.sleep(0.001)
        other = pool.submit(cache.read, shard(path, 0), path, expect)
        if first == "fails":
            with pytest.raises(StoreError, match="a failure of this read only"):
                one.result()
            assert other.result().nbytes == shard(path, 0).stat().st_size and len(calls) == 2  # then read there
        else:
            assert one.result() is other.result() and len(calls) == 1 and cache.reads == 1
    assert waiting.is_set()
