"""Faults and bad input: damaged shards, a full disk, hostile manifests and shard names, no pickle.

(A writer killed with SIGKILL is tested in test_writer.py. Hostile journal lines, manifests and files that
are not regular: test_hostile_index.py and test_hostile_manifests.py; hostile shard contents and shards
changed after a read: test_hostile_shards.py; torn journals and repair: test_hostile_repair.py.)
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hostilecases import (
    Expected,
    build_store,
    check,
    edit_line,
    journal,
    journal_objects,
    manifest,
    of_shard,
    save_manifest,
    shard,
    write_batches,
)
from storecases import synthetic_batch

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.errors import IncompleteStoreWarning, StoreError
from metastore_plugins.core.store import files as files_module
from metastore_plugins.core.store.reading import batches, readcache
from metastore_plugins.core.store.shards import shardread
from metastore_plugins.core.store.writing import writer as writer_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store4(tmp_path: Path) -> tuple[Path, Expected]:
    """Four fp32 shards of one batch each (sample ids 0..15), in ``tmp_path / "store"``."""
    path = tmp_path / "store"
    return path, build_store(path)


# -- damaged shards ----------------------------------------------------------------------------


def test_reading_a_shard_with_flipped_bytes_names_the_file_and_the_checksum(store4: tuple) -> None:
    path, expected = store4
    victim = shard(path, 1)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # inside tensor data: safetensors itself would not notice
    victim.write_bytes(bytes(data))
    store = open_store(path)
    with pytest.raises(  # queries check the line's xxh3_128 (verify: its sha256 too)
        StoreError, match=rf"{re.escape(victim.name)}: checksum mismatch, xxh3_128 [0-9a-f]{{32}} on disk"
    ):
        store.restore(5)
    with pytest.raises(StoreError, match="checksum mismatch"):  # every read of records, not just the first
        store.norms()
    assert store.sample_ids().tolist() == list(range(16))  # listing reads the journal, not the shards
    for i in (0, 2, 3):  # the other shards stay readable
        check(store, of_shard(expected, i))
        assert store.sample_ids(steps=i).tolist() == sorted(of_shard(expected, i))
    problems = store.verify()
    assert len(problems) == 1 and victim.name in problems[0] and "sha256" in problems[0]


def test_reading_a_truncated_shard_names_the_file(store4: tuple) -> None:
    path, expected = store4
    victim = shard(path, 2)
    victim.write_bytes(victim.read_bytes()[:-10])
    for checksums in (True, False):  # the size is checked even without checksums
        store = open_store(path, checksums=checksums)
        with pytest.raises(
            StoreError, match=rf"{re.escape(victim.name)}: size mismatch, \d+ bytes on disk but \d+ in the index"
        ):
            store.restore(9)
        check(store, of_shard(expected, 3))


def test_verify_reports_all_damage_at_once(store4: tuple) -> None:
    path, expected = store4
    flipped, truncated, missing = shard(path, 0), shard(path, 1), shard(path, 3)
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 1
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])
    missing.unlink()
    problems = open_store(path).verify()
    assert len(problems) == 3, problems
    for name in (flipped.name, truncated.name, missing.name):
        assert sum(name in problem for problem in problems) == 1, (name, problems)
    check(open_store(path), of_shard(expected, 2))


def test_a_shard_is_read_and_checked_once_while_its_file_is_unchanged(
    store4: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read once per process (the read cache) while the file's identity holds; without the cache, at every reopen."""
    path, expected = store4
    reads: list[tuple[str, tuple[str, ...]]] = []
    read = readcache.read_opened

    def counted(fd: int, opened: Any, file: Path, expect: Any) -> Any:
        reads.append((file.name, tuple(sorted(expect.digests()))))
        return read(fd, opened, file, expect)

    monkeypatch.setattr(readcache, "read_opened", counted)
    readcache.SHARDS.clear()
    store = open_store(path)
    assert reads == []  # opening reads no shard
    check(store, expected)
    store.norms()
    checked = tuple(sorted(store.index.expectation(0, True, fast=True).digests()))
    assert checked and sorted(reads) == [(shard(path, i).name, checked) for i in range(4)]
    del reads[:]
    open_store(path, checksums=False).norms()  # another store, the same files: nothing read again
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)  # each store keeps only the shard just used
    store = open_store(path)
    store.norms()
    store.norms()
    assert reads == []
    os.utime(shard(path, 2), ns=(0, 0))  # another identity: read and checked again, once
    store.norms()
    store.norms()
    assert reads == [(shard(path, 2).name, checked)]
    del reads[:]
    monkeypatch.setattr(readcache.SHARDS, "max_bytes", 0)  # no cache: read at every reopen
    readcache.SHARDS.clear()
    store = open_store(path)
    store.norms()
    store.norms()
    assert sorted(reads) == sorted([(shard(path, i).name, checked) for i in range(4)] * 2)
    readcache.SHARDS.clear()


# -- a full disk -------------------------------------------------------------------------------


def _full_disk_after(monkeypatch: pytest.MonkeyPatch, good: int) -> list[str]:
    """The shard saver writes ``good`` shards, then writes half a file and fails with ENOSPC."""
    calls: list[str] = []
    save = writer_module.write_shard

    def save_until_full(handle: Any, *args: Any) -> tuple[int, str]:
        calls.append(str(handle.name))
        if len(calls) <= good:
            return save(handle, *args)
        handle.write(b"\0" * 100)  # a partial file
        raise OSError(errno.ENOSPC, "No space left on device", str(handle.name))

    monkeypatch.setattr(writer_module, "write_shard", save_until_full)
    return calls


def test_a_full_disk_stops_capture_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _full_disk_after(monkeypatch, good=2)
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = write_batches(writer, range(2))
        writer.flush()
        write_batches(writer, range(2, 6))  # the third shard fails; later writes are dropped without error
        writer.flush()
        write_batches(writer, range(6, 9))
        writer.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert str(tmp_path) in messages[0] and "STOPPED CAPTURING" in messages[0]
    assert "2 shard(s) and 8 sample(s)" in messages[0] and "No space left" in messages[0]
    assert writer.stopped is not None and writer.stopped.errno == errno.ENOSPC
    assert len(calls) == 3  # nothing was attempted after the failure
    assert writer.stats.shards == 2
    assert not list(tmp_path.glob("*.tmp"))  # the partial file is removed
    store = open_store(tmp_path)  # what the store says of itself: incomplete from the first batch lost (step 2)
    assert store.verify() == [
        "INCOMPLETE store: capture stopped at step 2 after an error writing the store (OSError: [Errno 28] No space "
        f"left on device: {str(calls[2])!r}): nothing from step 2 on was stored, 28 sample(s) lost"
    ]
    with pytest.warns(IncompleteStoreWarning, match="capture stopped at step 2") as said:
        assert store.sample_ids().tolist() == sorted(expected)
    assert len(said) == 1
    assert store.sample_ids(steps=(0, 1)).tolist() == sorted(expected)  # before the stop: complete, no warning
    with pytest.warns(IncompleteStoreWarning, match="capture stopped at step 2"):
        check(store, expected)


def test_a_full_disk_can_raise_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _full_disk_after(monkeypatch, good=1)
    with pytest.raises(ValueError, match="on_error must be 'warn' or 'raise'"):
        StoreWriter(tmp_path / "x", on_error="ignore")  # type: ignore[arg-type]
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1, on_error="raise")
    expected = write_batches(writer, range(1))
    writer.flush()
    write_batches(writer, range(1, 2))
    with pytest.raises(RuntimeError, match=rf"writer for {re.escape(str(tmp_path))} failed.*No space left"):
        writer.flush()
    with pytest.raises(RuntimeError, match="No space left"):
        write_batches(writer, range(2, 3))
    with pytest.raises(RuntimeError, match="No space left"):
        writer.close()
    assert not list(tmp_path.glob("*.tmp"))
    store = open_store(tmp_path)
    assert len(store.verify()) == 1 and "capture stopped at step 1" in store.verify()[0]
    assert "4 sample(s) lost" in store.verify()[0]  # batch 1; batch 2 was refused before it was queued
    with pytest.warns(IncompleteStoreWarning, match="capture stopped at step 1"):
        assert store.sample_ids().tolist() == sorted(expected)


def test_a_full_disk_while_writing_the_manifest_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1)
    expected = write_batches(writer, range(2))
    writer.flush()
    before = (tmp_path / "manifest-rank0.json").read_bytes()
    replace = os.replace

    def replace_no_json(src: Any, dst: Any, **dir_fds: Any) -> None:
        if str(dst).endswith(".json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "replace", replace_no_json)
    records, _ = synthetic_batch(2)
    records[0] = dataclasses.replace(records[0], layer="fc2", params={"weight": "fc2.weight", "bias": "fc2.bias"})
    with pytest.warns(RuntimeWarning, match="STOPPED CAPTURING.*2 shard\\(s\\) and 8 sample\\(s\\)"):
        writer.write(records, sample_ids=torch.arange(4) + 8, step=2)  # a new layer: the manifest is rewritten
        writer.close()
    monkeypatch.undo()
    assert (tmp_path / "manifest-rank0.json").read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [shard(tmp_path, i).name for i in range(2)]
    assert len(journal_objects(tmp_path)) == 2  # the shard whose layer the manifest lacks was never listed
    store = open_store(tmp_path)
    assert len(store.verify()) == 1 and "capture stopped at step 2" in store.verify()[0]
    assert store.layers() == ["fc", "ln"]
    with pytest.warns(IncompleteStoreWarning, match="capture stopped at step 2"):
        check(store, expected)


def test_a_full_disk_while_appending_a_journal_line_cuts_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1)
    expected = write_batches(writer, range(2))
    writer.flush()
    before = journal(tmp_path).read_bytes()

    class HalfWrites:  # the store files' os module: a write stores half the line, then the disk is full
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        @staticmethod
        def pwrite(fd: int, data: Any, offset: int) -> int:
            os.pwrite(fd, bytes(data)[: len(data) // 2], offset)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_module, "os", HalfWrites())
    unrecorded = "the run log could not be written.*not know that the store lacks every step from 2 on$"
    with pytest.warns(RuntimeWarning, match=unrecorded):  # nor its line in the run log
        with pytest.warns(RuntimeWarning, match="STOPPED CAPTURING.*2 shard\\(s\\) and 8 sample\\(s\\)"):
            write_batches(writer, range(2, 3))
            writer.close()
    monkeypatch.undo()
    assert journal(tmp_path).read_bytes() == before  # the half line was cut off
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [shard(tmp_path, i).name for i in range(2)]
    store = open_store(tmp_path)
    assert store.verify() == []  # a disk that refuses every write refused the run log's line too (warned)
    check(store, expected)


def test_a_new_writer_removes_a_stale_manifest_tmp(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        expected = write_batches(writer, range(1))
    (tmp_path / "manifest-rank0.json.tmp").write_text('{"half": ')
    (tmp_path / "rank0-000001.safetensors.tmp").write_bytes(b"\0" * 10)
    (tmp_path / "manifest-rank1.json.tmp").write_text("another rank's")
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        more = write_batches(writer, range(1, 2))
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == ["manifest-rank1.json.tmp"]
    check(open_store(tmp_path), expected | more)


# -- hostile manifests and journal lines ------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../outside.safetensors",
        "/tmp/outside.safetensors",
        "sub/rank0-000000.safetensors",
        "..",
        ".hidden.safetensors",
        "rank1-000000.safetensors",  # another rank's shard
        "rank0-000000.safetensors\n",
        "x.json",
        7,
        None,
    ],
)
def test_shard_paths_outside_the_run_directory_are_ignored(
    store4: tuple, name: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = store4
    (path.parent / "outside.safetensors").write_bytes(shard(path, 0).read_bytes())  # a valid shard, outside
    edit_line(path, 0, lambda e: e.update(file=name))
    opened: list[Path] = []
    open_regular = shardread.open_regular

    def recorded(file: Path, directory: Path) -> Any:
        opened.append(file)
        return open_regular(file, directory)

    monkeypatch.setattr(shardread, "open_regular", recorded)
    store = open_store(path)  # the line is ignored, not trusted: the other shards stay readable
    with pytest.raises(StoreError, match="sample 1 is not stored"):
        store.restore(1)
    for i in (1, 2, 3):
        check(store, of_shard(expected, i))
    problems = store.verify()
    assert problems[0] == "index-rank0.jsonl line 1: file must be a rank0-NNNNNN.safetensors name; ignored"
    assert len(problems) == 2 and "rank0-000000.safetensors: a file not listed in the index" in problems[1]
    assert store.summary()["index_problems"] == 1 and store.sample_ids().tolist() == list(range(4, 16))
    assert sorted({p.name for p in opened}) == [shard(path, i).name for i in (1, 2, 3)]
    assert all(p.parent == path for p in opened)


def test_a_shard_that_links_outside_the_run_directory_is_not_read(
    store4: tuple, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path, expected = store4
    outside = tmp_path_factory.mktemp("outside") / "secret.safetensors"
    victim = shard(path, 0)
    victim.rename(outside)
    victim.symlink_to(outside)
    store = open_store(path)
    with pytest.raises(StoreError, match=f"{victim.name}: is a symbolic link; links are not followed"):
        store.restore(1)
    problems = store.verify()
    assert len(problems) == 1 and victim.name in problems[0] and "symbolic link" in problems[0]
    check(store, of_shard(expected, 1))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(schema_version=4), r"schema version 4; .* reads version 3 and older: upgrade"),
        (lambda m: m.update(schema_version="1"), "invalid schema version '1'"),
        (lambda m: m.update(schema_version=True), "invalid schema version True"),
        (lambda m: m.update(format="other"), 'not a metastore manifest \\(no "format": "metastore"\\)'),
        (lambda m: m.update(rank=-1), '"rank" must be an integer in 0..10\\^9'),
        (lambda m: m.update(rank=1), '"rank" is 1 but the file name says rank 0'),
        (lambda m: m.update(config=[]), '"config" must be an object'),
        (lambda m: m.update(layers=[]), '"layers" must be an object'),
        (lambda m: m.pop("layers"), '"layers" must be an object'),
        (lambda m: m["layers"]["fc"].update(params={}), '"params" must map roles to parameter names'),
        (
            lambda m: m["layers"]["fc"]["param_shapes"].update(weight=[5, "6"]),
            r"param_shapes\['weight'\] must be a list of at most 8 sizes",
        ),
        (lambda m: m["layers"]["fc"]["param_shapes"].pop("bias"), '"param_shapes" must give a shape per role'),
        (lambda m: m["layers"]["fc"].update(layout="sideways"), '"layout" must be one of'),
        (lambda m: m["layers"]["fc"].pop("layout"), '"layout" must be one of'),
    ],
)
def test_malformed_manifests_raise_a_clear_store_error(store4: tuple, edit: Any, message: str) -> None:
    path, _ = store4
    content = manifest(path)
    edit(content)
    save_manifest(path, content)
    with pytest.raises(StoreError, match=message) as raised:
        open_store(path)
    assert "manifest-rank0.json" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "null", '"metastore"', "\udcff", "[" * 100000])
def test_manifests_that_are_not_json_objects(tmp_path: Path, text: str) -> None:
    (tmp_path / "manifest-rank0.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(StoreError, match="manifest-rank0.json"):
        open_store(tmp_path)


def test_no_pickle_anywhere() -> None:
    """The store reads and writes only safetensors and JSON."""
    pattern = re.compile(r"\bpickle\b|torch\.load|torch\.save|np\.load|numpy\.load|allow_pickle|joblib|dill")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "metastore_plugins").rglob("*.py"))
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
