"""The tag book: tags written as checksummed journal lines, read back by every rank, searched by attributes."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.tags.book import TagBook, find_tags, read_tags
from metastore_plugins.core.store.tags.tag_line import Tag


def test_tags_round_trip_and_later_tags_win(tmp_path: Path) -> None:
    book = TagBook(tmp_path)
    book.add("warmup", steps=(0, 9), keep="norms", phase="start")
    book.add("spike", current_step=5, keep="exact", loss=7.25)
    book.add("val-only", steps=(0, 100), keep="projected", capture_point="epoch-0/val")
    assert book.keep_for(5, "train") == "exact"  # the later tag covering step 5
    assert book.keep_for(4, "train") == "norms" and book.keep_for(9, "train") == "norms"  # inclusive range
    assert book.keep_for(10, "train") is None
    assert book.keep_for(50, "epoch-0/val") == "projected"
    other = TagBook(tmp_path, rank=1)
    other.add("spike", steps=3, loss=2.0)
    tags = read_tags(tmp_path)
    assert [(t.name, t.rank, t.first_step, t.last_step) for t in tags] == [
        ("warmup", 0, 0, 9),
        ("spike", 0, 5, 5),
        ("val-only", 0, 0, 100),
        ("spike", 1, 3, 3),
    ]
    assert [t.rank for t in find_tags(tags, "spike")] == [0, 1]
    assert [t.attributes for t in find_tags(tags, "spike", loss=7.25)] == [{"loss": 7.25}]
    assert find_tags(tags, phase="start")[0].name == "warmup"
    assert TagBook(tmp_path).keep_for(5, "train") == "exact"  # reopened: the same book


@pytest.mark.filterwarnings("ignore:.*cut, so the next tag starts clean:UserWarning")  # the cut it checks, said
def test_a_torn_last_line_is_cut_and_a_damaged_one_is_named(tmp_path: Path) -> None:
    book = TagBook(tmp_path)
    book.add("a", steps=1)
    with open(book.path, "ab") as handle:
        handle.write(b'{"name": "half')  # a crash while appending
    assert [t.name for t in read_tags(tmp_path)] == ["a"]
    TagBook(tmp_path).add("b", steps=2)  # the torn tail is cut first: the new line starts clean
    assert [t.name for t in read_tags(tmp_path)] == ["a", "b"]
    data = book.path.read_bytes().replace(b'"a"', b'"x"', 1)  # its CRC no longer matches
    book.path.write_bytes(data)
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: line 1 is damaged"):
        read_tags(tmp_path)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"name": "", "steps": 1}, r"tag\(name=\.\.\.\)"),
        ({"name": "a\nb", "steps": 1}, r"tag\(name=\.\.\.\)"),
        ({"name": "x", "steps": (5, 2)}, r"tag\(steps=\.\.\.\) must satisfy"),
        ({"name": "x", "steps": -1}, r"tag\(steps=\.\.\.\) must satisfy"),
        ({"name": "x", "steps": "3"}, r"tag\(steps=\.\.\.\) must be a step"),
        ({"name": "x"}, r"tag\(steps=\.\.\.\) must be a step"),
        ({"name": "x", "steps": 1, "keep": "everything"}, r"tag\(keep=\.\.\.\) must be one of"),
        ({"name": "x", "steps": 1, "rank": 3}, r"\['rank'\] clash"),
        ({"name": "x", "steps": 1, "values": [1, 2]}, r"\['values'\] must be JSON scalars"),
        ({"name": "x", "steps": 1, "loss": float("nan")}, r"\['loss'\] must be JSON scalars"),
        ({"name": "x", "steps": 1, "capture_point": ""}, r"tag\(capture_point=\.\.\.\)"),
        ({"name": "x", "steps": 1, "capture_point": 3}, r"tag\(capture_point=\.\.\.\)"),
        ({"name": 7, "steps": 1}, r"tag\(name=\.\.\.\)"),
        ({"name": "x", "steps": (True, 2)}, r"tag\(steps=\.\.\.\) must be a step"),
    ],
)
def test_bad_tags_name_the_argument(tmp_path: Path, arguments: dict, message: str) -> None:
    book = TagBook(tmp_path)
    with pytest.raises(ValueError, match=message):
        book.add(**arguments)
    assert read_tags(tmp_path) == []  # nothing written


def test_every_field_round_trips(tmp_path: Path) -> None:
    book = TagBook(tmp_path, rank=2)
    written = [
        book.add("ckpt", steps=np.int64(7), automatic=True, attributes={"epoch": 1, "lr": 0.5}, best=True, note=None),
        book.add("window", steps=(3, 9), keep="snapshot", capture_point="epoch-0/val", current_step=4, who="me"),
    ]
    assert written[0] == Tag("ckpt", 7, 7, None, None, {"epoch": 1, "lr": 0.5, "best": True, "note": None}, 2, 0, True)
    assert written[1] == Tag("window", 3, 9, "snapshot", "epoch-0/val", {"who": "me"}, 2, 1, False)
    assert type(written[0].first_step) is int  # a numpy step is stored as a plain int
    assert read_tags(tmp_path) == written == book.tags
    assert TagBook(tmp_path, rank=2).add("next", steps=10).seq == 2  # a reopened book continues the order


def test_keep_for_passes_over_tags_that_say_nothing_about_representation(tmp_path: Path) -> None:
    book = TagBook(tmp_path)
    book.add("exact", steps=(0, 5), keep="exact")
    book.add("plain", steps=(0, 5), note="no keep")
    book.add("snap", steps=3, keep="snapshot")
    book.add("val", steps=(0, 5), keep="nothing", capture_point="epoch-0/val")
    assert book.keep_for(3, "train") == "exact"  # neither the later plain tag nor the snapshot tag overrides
    assert book.keep_for(3, "epoch-0/val") == "nothing"
    assert book.keep_for(6, "epoch-0/val") is None


def _line(entry: dict) -> bytes:
    text = json.dumps(entry, separators=(",", ":")).encode()
    return text + b" " + f"{zlib.crc32(text):08x}".encode() + b"\n"


@pytest.mark.filterwarnings("ignore:.*cut, so the next tag starts clean:UserWarning")  # the cut it checks, said
def test_a_damaged_last_line_is_skipped_then_cut_and_a_bad_middle_line_names_the_file(tmp_path: Path) -> None:
    book = TagBook(tmp_path)
    book.add("a", steps=1)
    good = book.path.stat().st_size
    with open(book.path, "ab") as handle:  # a complete last line whose CRC does not match
        handle.write(_line({"name": "b"})[:-3] + b"00\n")
    assert [t.name for t in read_tags(tmp_path)] == ["a"]
    reopened = TagBook(tmp_path)
    assert book.path.stat().st_size == good  # cut, so the next line does not follow a damaged one
    reopened.add("c", steps=2)
    assert [t.name for t in read_tags(tmp_path)] == ["a", "c"]
    # a line with a valid CRC but values a tag cannot hold, followed by another: an error naming file and line
    hostile = {"name": "h", "first_step": 5, "last_step": 1, "keep": None, "capture_point": None}
    hostile |= {"attributes": {}, "rank": 0, "seq": 2, "automatic": False}
    with open(book.path, "ab") as handle:
        handle.write(_line(hostile))
    TagBook(tmp_path, rank=0).add("d", steps=3)  # the hostile line was the last one: skipped, then cut
    assert [t.name for t in read_tags(tmp_path)] == ["a", "c", "d"]
    with open(book.path, "ab") as handle:
        handle.write(_line(hostile) + _line({**hostile, "first_step": 0}))
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: line 4 is damaged .*first_step"):
        read_tags(tmp_path)
    TagBook(tmp_path)  # a training start parses only the lines it uses: the last, and those that keep something
    with open(book.path, "ab") as handle:  # a hostile line that keeps something, followed by another
        handle.write(_line({**hostile, "keep": "exact"}) + _line({**hostile, "first_step": 0}))
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: line 6 is damaged .*first_step"):
        TagBook(tmp_path)


def test_a_failed_append_leaves_no_torn_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    book = TagBook(tmp_path)
    book.add("a", steps=1)
    size = book.path.stat().st_size

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", broken_fsync)
        with pytest.raises(OSError, match="No space"):
            book.add("lost", steps=2)
    assert book.path.stat().st_size == size and [t.name for t in book.tags] == ["a"]
    book.add("b", steps=3)
    assert [(t.name, t.seq) for t in read_tags(tmp_path)] == [("a", 0), ("b", 1)]


def test_a_missing_or_tagless_store_has_no_tags(tmp_path: Path) -> None:
    assert read_tags(tmp_path / "absent") == []
    (tmp_path / "tags-rank0.jsonl.tmp").write_text("junk")  # not a tags file
    assert read_tags(tmp_path) == []


# -- read once per process (issue 44 item 3): what is parsed, and that a change by another process is seen ---------


def _counting(monkeypatch: pytest.MonkeyPatch, module: object) -> list[dict]:
    """Every line ``module`` turns into a tag from now on (the decoded objects its ``tag_of`` is given)."""
    parsed: list[dict] = []
    original = module.tag_of  # type: ignore[attr-defined]

    def counting(entry: dict) -> object:
        parsed.append(entry)
        return original(entry)

    monkeypatch.setattr(module, "tag_of", counting)
    return parsed


def _many(path: Path, count: int) -> None:
    """``count`` tags that keep nothing, then one that keeps ``exact`` on steps 5..6 (written as a rank writes them)."""
    lines = [
        _line(
            {
                "name": f"t{i}",
                "first_step": i,
                "last_step": i,
                "keep": None,
                "capture_point": None,
                "attributes": {"i": i},
                "rank": 0,
                "seq": i,
                "automatic": True,
            }
        )
        for i in range(count)
    ]
    lines.append(_line({"name": "k", "first_step": 5, "last_step": 6, "keep": "exact", "capture_point": None,
                        "attributes": {}, "rank": 0, "seq": count, "automatic": False}))  # fmt: skip
    path.write_bytes(b"".join(lines))


def test_a_training_start_parses_the_last_line_and_the_lines_that_keep_something(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 tags of which one keeps ``exact``: the book parses that one (it is also the last), keeps its order and
    what it says (before: every line was parsed at each training start)."""
    import metastore_plugins.core.store.tags.book as tags_module

    _many(tmp_path / "tags-rank0.jsonl", 300)
    parsed = _counting(monkeypatch, tags_module)
    book = TagBook(tmp_path)
    assert len(parsed) <= 2 and all(entry["keep"] == "exact" for entry in parsed)
    assert book.keep_for(5, "train") == "exact" and book.keep_for(7, "train") is None
    assert book.add("next", steps=9).seq == 301  # the order goes on from the line count
    assert [t.seq for t in read_tags(tmp_path)][-2:] == [300, 301]


def test_a_second_read_parses_only_what_was_appended_and_sees_every_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After one read in the process, a line another book appends is the only one parsed (before: every line
    again); a line rewritten in place with its CRC recomputed and the size kept, or damaged, is seen."""
    import metastore_plugins.core.store.tags.book as tags_module

    _many(tmp_path / "tags-rank0.jsonl", 200)
    assert len(read_tags(tmp_path)) == 201
    parsed = _counting(monkeypatch, tags_module)
    TagBook(tmp_path).add("appended", steps=3)  # another writer of the rank (a second process, in effect)
    parsed.clear()
    assert [t.name for t in read_tags(tmp_path)][-1] == "appended" and len(parsed) == 1
    path = tmp_path / "tags-rank0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[0] = _line({**json.loads(lines[0].rsplit(b" ", 1)[0]), "name": "t9"})  # same length, CRC recomputed
    path.write_bytes(b"".join(lines))
    assert read_tags(tmp_path)[0].name == "t9"
    path.write_bytes(path.read_bytes().replace(b'"t9"', b'"t8"', 1))  # its CRC no longer matches
    with pytest.raises(StoreError, match=r"tags-rank0\.jsonl: line 1 is damaged"):
        read_tags(tmp_path)
