"""The query path's checksum (issue 35): ``xxh3_128`` recorded beside ``sha256`` in every journal line
written now, checked alone by queries; ``sha256`` kept for ``verify``, repair and compaction; stores whose
lines predate the field read as before, checked with ``sha256``.

References: ``xxhash`` and ``hashlib`` over the file's bytes, read here.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import xxhash
from hostilecases import build_store, check, edit_line, journal_objects, of_shard, shard

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.maintenance.compaction import compact, repair
from metastore_plugins.core.store.reading import readcache

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    readcache.SHARDS.clear()  # every read below comes from disk


def _flip(file: Path, at: int = -3) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x10  # inside tensor data
    file.write_bytes(bytes(data))


def _matches_file(entry: dict, directory: Path) -> bool:
    data = (directory / entry["file"]).read_bytes()
    return entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_new_lines_record_the_xxh3_128_of_their_shard(tmp_path: Path) -> None:
    build_store(tmp_path)
    entries = journal_objects(tmp_path)
    assert len(entries) == 4 and all(_matches_file(entry, tmp_path) for entry in entries)
    assert list(entries[0])[:4] == ["file", "bytes", "sha256", "xxh3_128"]


def test_queries_check_xxh3_128_and_verify_checks_sha256_too(tmp_path: Path) -> None:
    expected = build_store(tmp_path)
    edit_line(tmp_path, 1, lambda e: e.update(sha256="0" * 64))  # only the slow checksum disagrees
    edit_line(tmp_path, 2, lambda e: e.update(xxh3_128="0" * 32))  # only the fast one disagrees
    store = open_store(tmp_path)
    check(store, of_shard(expected, 1))  # a query trusts the line's xxh3_128 alone
    with pytest.raises(StoreError, match=rf"{shard(tmp_path, 2).name}: checksum mismatch, xxh3_128 [0-9a-f]{{32}} on"):
        store.restore(9)
    slow, fast = hashlib.sha256(shard(tmp_path, 1).read_bytes()), xxhash.xxh3_128(shard(tmp_path, 2).read_bytes())
    assert store.verify() == [
        f"{shard(tmp_path, 1).name}: checksum mismatch, sha256 {slow.hexdigest()} on disk but {'0' * 64} in the index "
        "(the file is damaged)",
        f"{shard(tmp_path, 2).name}: checksum mismatch, xxh3_128 {fast.hexdigest()} on disk but {'0' * 32} in the "
        "index (the file is damaged)",
    ]
    _flip(shard(tmp_path, 3))
    with pytest.raises(StoreError, match=f"{shard(tmp_path, 3).name}: checksum mismatch, xxh3_128"):
        open_store(tmp_path).restore(13)  # a flipped bit is caught by the fast checksum


def test_lines_written_before_the_field_are_checked_with_sha256(tmp_path: Path) -> None:
    expected = build_store(tmp_path)
    for i in range(4):
        edit_line(tmp_path, i, lambda e: e.pop("xxh3_128"))  # as a writer before issue 35 wrote them
    check(open_store(tmp_path), expected)
    _flip(shard(tmp_path, 1))
    store = open_store(tmp_path)
    with pytest.raises(StoreError, match=f"{shard(tmp_path, 1).name}: checksum mismatch, sha256"):
        store.restore(5)
    check(store, of_shard(expected, 2))
    assert len(store.verify()) == 1


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_golden_stores_without_the_field_still_catch_a_flipped_bit(tmp_path: Path, name: str) -> None:
    store_dir = tmp_path / "store"
    shutil.copytree(GOLDEN / f"store_{name}", store_dir)
    assert all("xxh3_128" not in entry for entry in journal_objects(store_dir))
    first = journal_objects(store_dir)[0]["file"]
    sound = open_store(store_dir)
    points = sound.capture_points()
    assert sound.verify() == [] and all(len(sound.norms(cp)) for cp in points)
    _flip(store_dir / first)
    with pytest.raises(StoreError, match=f"{first}: checksum mismatch, sha256"):
        for cp in points:
            open_store(store_dir).norms(cp)


@pytest.mark.parametrize("bad", ["0" * 31, "A" * 32, 7, None, ["0" * 32]])
def test_a_malformed_xxh3_128_ignores_the_line(tmp_path: Path, bad: object) -> None:
    expected = build_store(tmp_path)
    edit_line(tmp_path, 1, lambda e: e.update(xxh3_128=bad))
    store = open_store(tmp_path)
    if bad is None:  # null: as if absent, checked with sha256
        check(store, expected)
        return
    assert store.verify()[0] == "index-rank0.jsonl line 2: xxh3_128 must be 32 hex digits; ignored"
    assert sorted(store.sample_ids().tolist()) == sorted(set(range(16)) - set(of_shard(expected, 1)))


def test_compaction_and_repair_write_lines_with_both_checksums(tmp_path: Path) -> None:
    expected = build_store(tmp_path)
    assert compact(tmp_path, target_bytes=1 << 30).merged
    (entry,) = journal_objects(tmp_path)
    assert _matches_file(entry, tmp_path)
    check(open_store(tmp_path), expected)
    other = tmp_path / "other"
    build_store(other)
    lines = (other / "index-rank0.jsonl").read_bytes().splitlines(keepends=True)
    (other / "index-rank0.jsonl").write_bytes(b"".join(lines[:1] + lines[2:]))  # shard 1's line lost
    repair(other)
    relisted = [e for e in journal_objects(other) if e["file"] == shard(other, 1).name]
    assert len(relisted) == 1 and _matches_file(relisted[0], other)
    check(open_store(other), expected)
