"""The store's one way of opening files (``core/store/files.py``): links, planted temporaries, FIFOs, devices, caps.

Every case keeps decoy files outside the store and compares their sha256 (and the outside
directory's listing) before and after: nothing outside is ever written, created or truncated.
Calls that could block (a FIFO, /dev/zero) run in a thread joined with a timeout, so a
regression fails instead of hanging.
"""

from __future__ import annotations

import hashlib
import os
import threading
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store import files as files_module
from metastore_plugins.core.store.file_kinds import TEMPORARY_NAME, temporary_target
from metastore_plugins.core.store.files import StoreDir

PROMPT = 5.0  # seconds: a refusal takes microseconds; a blocked open never returns


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (links not followed), by relative path."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[str(path.relative_to(folder))] = "directory" if path.is_dir() else "other"
    return found


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    """``(store, outside)``: an empty store directory and a folder of decoys beside it."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    (outside / "folder").mkdir(parents=True)
    (outside / "decoy.txt").write_bytes(b"decoy bytes that must never change\n")
    (outside / "folder" / "inner.txt").write_bytes(b"inner decoy\n")
    return store, outside


LINKS = ["to_file", "dangling", "to_directory"]


def _plant_link(store: Path, outside: Path, name: str, how: str) -> None:
    target = {"to_file": outside / "decoy.txt", "dangling": outside / "created.txt", "to_directory": outside / "folder"}
    (store / name).symlink_to(target[how])


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result or exception, failing the test if it does not return within ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call blocked for {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.parametrize("how", LINKS)
def test_a_link_at_a_name_is_never_followed(places: tuple[Path, Path], how: str) -> None:
    store, outside = places
    before = _digests(outside)
    _plant_link(store, outside, "index-rank0.jsonl", how)
    with StoreDir(store) as d:
        assert d.kind("index-rank0.jsonl") == "link"
        with pytest.raises(StoreError, match=r"index-rank0\.jsonl: is a symbolic link"):
            d.read("index-rank0.jsonl", 1 << 20, "journal")
        with pytest.raises(StoreError, match="symbolic link"):
            d.open_read("index-rank0.jsonl")
        with pytest.raises(StoreError, match="symbolic link"):
            d.open_append("index-rank0.jsonl", 0)
        with pytest.raises(StoreError, match="symbolic link"):
            d.open_lock("index-rank0.jsonl")
        with pytest.raises(StoreError, match="symbolic link.*remove the link"):
            d.subdir("index-rank0.jsonl", create=True)
    assert _digests(outside) == before
    assert (store / "index-rank0.jsonl").is_symlink()


@pytest.mark.parametrize("how", LINKS)
def test_atomic_write_replaces_a_link_and_remove_unlinks_it(places: tuple[Path, Path], how: str) -> None:
    store, outside = places
    before = _digests(outside)
    _plant_link(store, outside, "manifest-rank0.json", how)
    _plant_link(store, outside, "other.json", how)
    with StoreDir(store) as d:
        d.atomic_write("manifest-rank0.json", b"new bytes")
        d.remove("other.json")
    assert not (store / "manifest-rank0.json").is_symlink()
    assert (store / "manifest-rank0.json").read_bytes() == b"new bytes"
    assert not os.path.lexists(store / "other.json")
    assert sorted(os.listdir(store)) == ["manifest-rank0.json"]  # no temporary left
    assert _digests(outside) == before


def test_a_planted_file_or_link_at_a_guessable_temporary_name_is_never_written_through(
    places: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, outside = places
    before = _digests(outside)
    (store / "manifest-rank0.json").write_bytes(b"old")
    (store / "manifest-rank0.json.tmp").symlink_to(outside / "decoy.txt")  # the name used before
    (store / "index-rank0.jsonl.tmp").write_bytes(b"planted file")
    with StoreDir(store) as d:
        d.atomic_write("manifest-rank0.json", b"new")
        d.atomic_write("index-rank0.jsonl", lambda handle: handle.write(b"line\n"))
        monkeypatch.setattr(files_module.secrets, "token_hex", lambda n: "0123456789abcdef")  # a predicted name
        (store / "manifest-rank0.json.0123456789abcdef.tmp").symlink_to(outside / "decoy.txt")
        with pytest.raises(FileExistsError):  # O_EXCL: refused, not written through
            d.atomic_write("manifest-rank0.json", b"newer")
    assert (store / "manifest-rank0.json").read_bytes() == b"new"
    assert (store / "index-rank0.jsonl").read_bytes() == b"line\n"
    assert (store / "index-rank0.jsonl.tmp").read_bytes() == b"planted file"
    assert (store / "manifest-rank0.json.tmp").is_symlink()
    assert _digests(outside) == before


def test_a_failed_atomic_write_leaves_the_file_and_no_temporary(places: tuple[Path, Path]) -> None:
    store, _ = places
    (store / "a.json").write_bytes(b"as it was")

    def half(handle: Any) -> None:
        handle.write(b"half")
        raise OSError(28, "No space left on device")

    with StoreDir(store) as d, pytest.raises(OSError, match="No space"):
        d.atomic_write("a.json", half)
    assert os.listdir(store) == ["a.json"]
    assert (store / "a.json").read_bytes() == b"as it was"


def test_a_fifo_and_dev_zero_are_refused_without_blocking(places: tuple[Path, Path]) -> None:
    store, outside = places
    before = _digests(outside)
    os.mkfifo(store / "tags.jsonl")
    (store / "zero.json").symlink_to("/dev/zero")
    with StoreDir(store) as d:
        assert d.kind("tags.jsonl") == "special"
        for name in ("tags.jsonl", "zero.json"):
            for call in (
                partial(d.read, name, 1 << 20, "tags"),
                partial(d.open_read, name),
                partial(d.open_append, name, 0),
                partial(d.open_lock, name),
            ):
                with pytest.raises(StoreError, match="FIFO|symbolic link"):
                    _within(PROMPT, call)
    assert _digests(outside) == before


def test_a_directory_is_refused_as_a_file_and_never_removed(places: tuple[Path, Path]) -> None:
    store, _ = places
    (store / "rank0.lock").mkdir()
    (store / "rank0.lock" / "keep").write_bytes(b"kept")
    with StoreDir(store) as d:
        assert d.kind("rank0.lock") == "directory"
        with pytest.raises(StoreError, match=r"rank0\.lock: is a directory"):
            d.open_lock("rank0.lock")
        with pytest.raises(StoreError, match="is a directory"):
            d.atomic_write("rank0.lock", b"x")
        with pytest.raises(StoreError, match="is a directory; not removed"):
            d.remove("rank0.lock")
        with pytest.raises(StoreError, match="not the name of an entry"):
            d.open_read("../outside/decoy.txt")
    assert (store / "rank0.lock" / "keep").read_bytes() == b"kept"


def test_subdir_is_a_real_directory_opened_without_links(places: tuple[Path, Path]) -> None:
    store, outside = places
    before = _digests(outside)
    (store / "snapshots").symlink_to(outside / "folder")
    (store / "reports").write_bytes(b"a file")
    with StoreDir(store) as d:
        with pytest.raises(StoreError, match="snapshots: is a symbolic link"):
            d.subdir("snapshots")
        with pytest.raises(StoreError, match="reports: is not a directory"):
            d.subdir("reports", create=True)
        with d.subdir("sketches", create=True) as sub:
            sub.atomic_write("a.bin", b"inside")
    assert (store / "sketches" / "a.bin").read_bytes() == b"inside"
    assert _digests(outside) == before


def test_open_append_cuts_a_torn_tail_and_append_writes_at_the_offset(places: tuple[Path, Path]) -> None:
    store, _ = places
    (store / "j.jsonl").write_bytes(b"line 1\ntorn")
    with StoreDir(store) as d:
        fd = d.open_append("j.jsonl", 7)
        try:
            StoreDir.append(fd, 7, b"line 2\n")
        finally:
            os.close(fd)
        with pytest.raises(StoreError, match="fewer than the 100 just read"):
            d.open_append("j.jsonl", 100)
    assert (store / "j.jsonl").read_bytes() == b"line 1\nline 2\n"


def test_reads_are_bounded_by_the_cap_not_allocated_to_it(
    places: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = places
    (store / "m.json").write_bytes(b"x" * 1000)
    with StoreDir(store) as d:
        with pytest.raises(StoreError, match=r"m\.json: manifest of 1000 bytes is larger than the 999 bytes"):
            d.read("m.json", 999, "manifest")
        tracemalloc.start()
        try:
            assert d.read("m.json", 1 << 30, "manifest") == b"x" * 1000
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 22  # a 1 GiB cap costs nothing: memory follows the file

        opened = StoreDir.open_read

        def grows(self: StoreDir, name: str) -> tuple[int, os.stat_result]:
            result = opened(self, name)
            with open(store / name, "ab") as handle:  # another program appends after the fstat
                handle.write(b"y" * 5000)
            return result

        monkeypatch.setattr(StoreDir, "open_read", grows)
        with pytest.raises(StoreError, match="grew past 4096 bytes while it was read"):
            d.read("m.json", 4096, "manifest")


def test_move_into_never_replaces_an_entry_and_moves_a_link_not_its_target(places: tuple[Path, Path]) -> None:
    store, outside = places
    before = _digests(outside)
    (store / "rank0-000001.safetensors").write_bytes(b"shard bytes")
    (store / "quarantine").mkdir()
    (store / "quarantine" / "rank0-000001.safetensors").write_bytes(b"set aside before")
    (store / "rank0-000002.safetensors").symlink_to(outside / "decoy.txt")
    with StoreDir(store) as d, d.subdir("quarantine") as aside:
        assert d.move_into("rank0-000001.safetensors", aside) == "rank0-000001.safetensors.1"
        assert d.move_into("rank0-000002.safetensors", aside) == "rank0-000002.safetensors"
        with pytest.raises(StoreError, match="is a directory; not moved"):
            d.move_into("quarantine", aside)
    assert (store / "quarantine" / "rank0-000001.safetensors").read_bytes() == b"set aside before"
    assert (store / "quarantine" / "rank0-000001.safetensors.1").read_bytes() == b"shard bytes"
    assert (store / "quarantine" / "rank0-000002.safetensors").is_symlink()
    assert sorted(os.listdir(store)) == ["quarantine"]
    assert _digests(outside) == before


def test_temporary_names_are_unguessable_and_name_their_target() -> None:
    assert temporary_target("index-rank0.jsonl.0123456789abcdef.tmp") == "index-rank0.jsonl"
    assert temporary_target("index-rank0.jsonl.tmp") is None
    assert temporary_target("a.0123456789ABCDEF.tmp") is None
    assert TEMPORARY_NAME.fullmatch("rank0-000001.safetensors.00000000000000ff.tmp")
