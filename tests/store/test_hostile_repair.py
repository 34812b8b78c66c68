"""A broken journal and leftovers (issue 18): a torn tail, a damaged line in the middle, a shard without its
line, a line without its shard; the store opens, the rest reads exactly, ``verify()`` lists each, and
``repair`` re-lists shards whose line was lost, removes copies and never touches a listed shard.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from hostilecases import (
    Expected,
    build_store,
    check,
    golden_v1,
    journal,
    of_shard,
    sha256,
    shard,
    write_batches,
)

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.maintenance.compaction import repair

FIX = "`metastore verify --repair` lists it again, or removes it when listed shards hold a copy"
UNLISTED = "a file not listed in the index (a shard in flight when the run stopped, or one replaced by compaction)"


@pytest.fixture
def store6(tmp_path: Path) -> tuple[Path, Expected]:
    """Six fp32 shards of one batch each (sample ids 0..23), in ``tmp_path / "store"``."""
    path = tmp_path / "store"
    return path, build_store(path, shards=6)


def _lines(path: Path) -> list[bytes]:
    return journal(path).read_bytes().splitlines(keepends=True)


def _torn_tail(path: Path) -> None:  # the writer died while appending the last line
    lines = _lines(path)
    journal(path).write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])


def _damaged_crc(path: Path) -> None:  # one bit of a middle line flipped
    lines = _lines(path)
    lines[2] = lines[2].replace(b'"encoding":"fp32"', b'"encoding":"fp33"')
    journal(path).write_bytes(b"".join(lines))


def _orphan(path: Path) -> None:  # a shard written but not listed: the run stopped before its line
    shutil.copyfile(shard(path, 0), shard(path, 7))


def _gone(path: Path) -> None:  # a listed shard deleted
    shard(path, 4).unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], list[str], set[int]]] = {
    # damage -> (make it, verify's lines, the shards left unreadable)
    "torn tail": (
        _torn_tail,
        [
            "index-rank0.jsonl line 6: torn: the line does not end (the writer stopped while appending it); ignored",
            f"rank0-000005.safetensors: {UNLISTED}; ignored; {FIX}",
        ],
        {5},
    ),
    "damaged line": (
        _damaged_crc,
        [
            "index-rank0.jsonl line 3: damaged: its CRC-32 does not match its content; ignored",
            f"rank0-000002.safetensors: {UNLISTED}; ignored; {FIX}",
        ],
        {2},
    ),
    "shard without line": (
        _orphan,
        [f"rank0-000007.safetensors: {UNLISTED}; ignored; {FIX}"],
        set(),
    ),
    "line without shard": (_gone, ["rank0-000004.safetensors: missing on disk"], {4}),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_the_store_opens_reads_the_rest_exactly_and_lists_the_damage(store6: tuple, damage: str) -> None:
    path, expected = store6
    make, lines, unreadable = DAMAGE[damage]
    make(path)
    store = open_store(path)
    assert store.verify() == lines
    assert store.summary()["index_problems"] == int(damage in ("torn tail", "damaged line"))
    for i in set(range(6)) - unreadable:
        check(store, of_shard(expected, i))
    listed = set(range(6)) - (unreadable if damage != "line without shard" else set())  # listing reads the journal
    assert store.sample_ids().tolist() == sorted(k for i in listed for k in of_shard(expected, i))


@pytest.mark.parametrize("journal_state", ["missing", "empty", "every line damaged", "a writer has not written yet"])
def test_a_store_with_no_trusted_line_opens_empty(tmp_path: Path, journal_state: str) -> None:
    path = tmp_path / "store"
    build_store(path, shards=2)
    writer = None
    if journal_state == "missing":
        journal(path).unlink()
    elif journal_state == "empty":
        journal(path).write_bytes(b"")
    elif journal_state == "every line damaged":
        journal(path).write_bytes(b"".join(line.replace(b"fp32", b"fp33") for line in _lines(path)))
    else:
        shutil.rmtree(path)
        writer = StoreWriter(path, encoding="fp32")  # the manifest is written when it opens
    try:
        store = open_store(path)
        assert store.sample_ids().tolist() == [] and store.capture_points() == [] and store.steps() == []
        assert store.summary()["samples"] == 0 and store.summary()["shards"] == 0
        assert store.metadata()["sample_id"].tolist() == [] and len(store.table()) == 0
        with pytest.raises(StoreError, match="sample 0 is not stored"):
            store.restore(0)
        problems = store.verify()
        assert len(problems) == (0 if writer else 2 + 2 * (journal_state == "every line damaged"))
        assert all(f"{UNLISTED}; ignored" in line for line in problems if line.startswith("rank0-"))
    finally:
        if writer is not None:
            writer.close()


def test_repair_relists_what_it_can_removes_copies_and_never_touches_a_listed_shard(store6: tuple) -> None:
    path, expected = store6
    for make, _, _ in DAMAGE.values():
        make(path)
    for name in ("rank0-000009.safetensors.tmp", "manifest-rank0.json.tmp", "index-rank0.jsonl.tmp"):
        (path / name).write_bytes(b"half")
    (path / "rank3-000000.safetensors.tmp").write_bytes(b"a rank with no manifest")
    (path / "notes.tmp").write_text("not the store's: left alone")
    sound = {i: sha256(shard(path, i)) for i in (0, 1, 2, 3, 5)}
    assert len(open_store(path).verify()) == 10  # 6 lines for the 4 damages, 4 temporary files
    removed = repair(path)
    relisted = "listed again (its journal line rebuilt from the shard's own description)"
    assert sorted(removed) == sorted(
        [
            "index-rank0.jsonl.tmp: removed (a temporary file)",
            "manifest-rank0.json.tmp: removed (a temporary file)",
            f"rank0-000002.safetensors: {relisted}",  # its line was damaged: the shard is good data
            f"rank0-000005.safetensors: {relisted}",  # its line was torn
            "rank0-000007.safetensors: removed (a copy: listed shards hold each of its batches byte for byte)",
            "rank0-000009.safetensors.tmp: removed (a temporary file)",
            "rank3-000000.safetensors.tmp: removed (a temporary file)",
            "index-rank0.jsonl: removed the entry of rank0-000004.safetensors (the file is gone)",
            "removed: index-rank0.jsonl line 3: damaged: its CRC-32 does not match its content; ignored",
            "removed: index-rank0.jsonl line 6: torn: the line does not end (the writer stopped while appending it); "
            "ignored",
        ]
    )
    assert {i: sha256(shard(path, i)) for i in (0, 1, 2, 3, 5)} == sound
    assert (path / "notes.tmp").exists()
    store = open_store(path)
    assert store.verify() == []
    kept = (0, 1, 2, 3, 5)
    for i in kept:
        check(store, of_shard(expected, i))
    assert store.sample_ids().tolist() == sorted(k for i in kept for k in of_shard(expected, i))
    assert repair(path) == []  # nothing is left to do
    with StoreWriter(path, encoding="fp32", shard_bytes=1) as writer:  # a writer continues the repaired store
        more = write_batches(writer, range(10, 11))
    assert writer.stats.files == ["rank0-000006.safetensors"]  # after the highest number on disk or listed
    assert {i: sha256(shard(path, i)) for i in kept} == sound
    check(open_store(path), more)


def test_a_writer_cuts_a_torn_tail_before_it_appends(store6: tuple) -> None:
    path, expected = store6
    _torn_tail(path)
    with StoreWriter(path, encoding="fp32", shard_bytes=1) as writer:
        more = write_batches(writer, range(6, 7))
    store = open_store(path)
    assert store.verify() == [f"rank0-000005.safetensors: {UNLISTED}; ignored; {FIX}"]
    assert [line.endswith(b"\n") for line in _lines(path)] == [True] * 6
    check(store, of_shard(expected, 0) | more)


def test_repair_never_touches_a_listed_shard_even_a_damaged_one(store6: tuple) -> None:
    path, _ = store6
    data = bytearray(shard(path, 1).read_bytes())
    data[-1] ^= 1
    shard(path, 1).write_bytes(bytes(data))
    before = {i: sha256(shard(path, i)) for i in range(6)}
    lines = _lines(path)
    assert repair(path) == []
    assert {i: sha256(shard(path, i)) for i in range(6)} == before and _lines(path) == lines
    assert len(open_store(path).verify()) == 1


def test_repair_removes_a_link_not_its_target_and_leaves_a_directory(store6: tuple, tmp_path: Path) -> None:
    path, _ = store6
    target = tmp_path / "precious.safetensors"
    target.write_bytes(b"someone else's file")
    shard(path, 8).symlink_to(target)
    shard(path, 9).mkdir()
    problems = open_store(path).verify()
    assert problems[0].startswith("rank0-000008.safetensors: a symbolic link not listed in the index")
    assert problems[1].startswith("rank0-000009.safetensors: a directory not listed") and "yourself" in problems[1]
    assert repair(path) == [
        "rank0-000008.safetensors: removed (a link, not a shard; a link's target is left alone)",
        "rank0-000009.safetensors: a directory where a shard would be; NOT removed, remove it yourself",
    ]
    assert target.read_bytes() == b"someone else's file" and not os.path.lexists(shard(path, 8))


def test_repair_refuses_to_run_beside_a_writer(store6: tuple) -> None:
    path, _ = store6
    _orphan(path)
    with StoreWriter(path, encoding="fp32"):
        with pytest.raises(StoreError, match="rank 0 is in use by another writer"):
            repair(path)
    assert shard(path, 7).exists()


def test_repair_of_a_version_1_store_sets_copies_aside_and_keeps_its_manifests(tmp_path: Path) -> None:
    """A version 1 shard does not describe its batches (capture point, step), so equal tensors and sample ids do
    not prove a copy (issue 44): the unlisted file is set aside, never deleted."""
    path = golden_v1(tmp_path / "store")
    manifests = {p.name: p.read_bytes() for p in path.glob("manifest-*.json")}
    shutil.copyfile(path / "rank0-000000.safetensors", path / "rank0-000002.safetensors")
    copied = (path / "rank0-000002.safetensors").read_bytes()
    assert repair(path) == [
        "rank0-000002.safetensors: set aside as quarantine/rank0-000002.safetensors (this rank has no manifest, or "
        "a version 1 one: it cannot be listed); NOT deleted: move it back once the store can list it, or delete it "
        "yourself"
    ]
    assert (path / "quarantine" / "rank0-000002.safetensors").read_bytes() == copied
    assert {p.name: p.read_bytes() for p in path.glob("manifest-*.json")} == manifests
    assert open_store(path).verify() == [
        "quarantine/: 1 file(s) set aside by `metastore verify --repair`; see docs/store.md#compaction-and-repair"
    ]
