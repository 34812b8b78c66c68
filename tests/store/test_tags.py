"""The tag book: tags written as checksummed journal lines, read back by every rank, searched by attributes."""

from __future__ import annotations

from pathlib import Path

import pytest

from metastore_plugins.core.policy.tags import TagBook, find_tags, read_tags
from metastore_plugins.core.store.manifest import StoreError


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
    ],
)
def test_bad_tags_name_the_argument(tmp_path: Path, arguments: dict, message: str) -> None:
    book = TagBook(tmp_path)
    with pytest.raises(ValueError, match=message):
        book.add(**arguments)
    assert read_tags(tmp_path) == []  # nothing written
