"""Hostile tags files (issue 29): links, FIFOs, /dev/zero, a directory, oversized and damaged files.

Each refusal must name the file and come within :data:`hostilecases.PROMPT` seconds; files outside
the store (decoys) are checked by their sha256 before and after.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
from hostilecases import PROMPT, sha256, within

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.tags.book import MAX_TAGS_BYTES, TagBook, check_tags, read_tags

pytestmark = pytest.mark.filterwarnings("ignore:.*cut, so the next tag starts clean")


def _store(tmp_path: Path) -> tuple[Path, Path, str]:
    """A store directory and, beside it, a decoy file holding a real tag line and garbage, with its sha256."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    outside.mkdir()
    TagBook(outside).add("outside", steps=1)
    decoy = outside / "tags-rank0.jsonl"
    with open(decoy, "ab") as handle:
        handle.write(b"garbage without a newline")  # TagBook would cut this tail if it followed the link
    return store, decoy, sha256(decoy)


def test_a_tags_file_linked_outside_is_neither_cut_nor_appended(tmp_path: Path) -> None:
    store, decoy, digest = _store(tmp_path)
    (store / "tags-rank0.jsonl").symlink_to(decoy)
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: is a symbolic link"):
        TagBook(store)
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: is a symbolic link"):
        read_tags(store)
    assert sha256(decoy) == digest


def test_a_dangling_tags_link_creates_nothing_outside(tmp_path: Path) -> None:
    store, decoy, digest = _store(tmp_path)
    target = decoy.parent / "created.jsonl"
    (store / "tags-rank0.jsonl").symlink_to(target)
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: is a symbolic link"):
        TagBook(store).add("t", steps=1)
    assert not target.exists() and sha256(decoy) == digest


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_tags_path_that_is_not_a_file_is_refused_promptly(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "tags-rank0.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    message = r"tags-rank0\.jsonl: (is a FIFO|is a symbolic link|is a directory)"
    for call in (lambda: TagBook(tmp_path), lambda: read_tags(tmp_path)):
        with pytest.raises(StoreError, match=message):
            within(PROMPT, call)
    tags, problems = within(PROMPT, lambda: check_tags(tmp_path))
    assert tags == [] and len(problems) == 1 and "tags-rank0.jsonl" in problems[0]


def test_a_tags_file_beyond_the_cap_is_refused_unread(tmp_path: Path) -> None:
    TagBook(tmp_path).add("t", steps=1)
    path = tmp_path / "tags-rank0.jsonl"
    os.truncate(path, MAX_TAGS_BYTES + 1)  # sparse: no disk used
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: a tags file of \d+ bytes is larger"):
        within(PROMPT, lambda: read_tags(tmp_path))
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: a tags file"):
        within(PROMPT, lambda: TagBook(tmp_path))
    assert path.stat().st_size == MAX_TAGS_BYTES + 1  # not cut


def test_a_garbage_last_line_is_reported_and_cut_with_a_warning(tmp_path: Path) -> None:
    book = TagBook(tmp_path)
    book.add("kept", steps=1)
    good = book.path.stat().st_size
    with open(book.path, "ab") as handle:
        handle.write(b"\x1b]0;garbage\x07 not a tag line\n")
    tags, problems = check_tags(tmp_path)
    assert [t.name for t in tags] == ["kept"]
    assert len(problems) == 1 and "tags-rank0.jsonl: line 2 is damaged" in problems[0]
    with pytest.warns(UserWarning, match=r"tags-rank0\.jsonl: line 2 is damaged.*cut"):
        TagBook(tmp_path)
    assert book.path.stat().st_size == good and check_tags(tmp_path) == (tags, [])


def _signed(text: bytes) -> bytes:
    """A line with its CRC recomputed (the write access a forger of the tags file has)."""
    return text + b" " + f"{zlib.crc32(text):08x}".encode() + b"\n"


def test_lines_that_pair_into_one_object_are_named_not_joined(tmp_path: Path) -> None:
    """Three signed lines, none a JSON object alone, that parse as three objects once joined into an array
    (``{"a":[{}`` + ``{}]}`` and ``{},{}``): the first is named, as when each line is parsed alone."""
    book = TagBook(tmp_path)
    book.add("before", steps=1)
    with open(book.path, "ab") as handle:
        handle.write(_signed(b'{"a":[{}') + _signed(b"{}]}") + _signed(b"{},{}"))
    book.add("after", steps=2)
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: line 2 is damaged \(damaged: not JSON"):
        read_tags(tmp_path)


def test_a_name_lookup_checks_every_line_and_finds_an_escaped_name(tmp_path: Path) -> None:
    """``read_tags(name=...)`` parses only lines that can hold the name, yet a line written with the name escaped
    (``\\u0072are``) is found, and a damaged line that does not hold it still stops the read, named."""
    book = TagBook(tmp_path)
    for step in range(5):
        book.add("common", steps=step)
    book.add("rare", steps=7)
    entry = b'{"name":"\\u0072are","first_step":9,"last_step":9,"keep":null,"capture_point":null,'
    entry += b'"attributes":{},"rank":0,"seq":6,"automatic":false}'
    with open(book.path, "ab") as handle:
        handle.write(_signed(entry))
    assert [(t.name, t.first_step) for t in read_tags(tmp_path, "rare")] == [("rare", 7), ("rare", 9)]
    lines = book.path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"common"', b'"commoN"')  # its CRC no longer matches
    book.path.write_bytes(b"".join(lines) + lines[0])
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: line 3 is damaged \(damaged: its CRC-32"):
        read_tags(tmp_path, "rare")
