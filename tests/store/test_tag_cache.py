"""The tag cache (``tag_cache/``, issue 44 item 3): ``find()`` answers from columns built once, parses only the
lines appended since, never answers from a cache that does not match the tags file's bytes, rebuilds a damaged
one, and answers on a store it cannot write. References: the tags file's lines decoded here with ``json``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store.maintenance.repair import repair

CACHE = Path("tag_cache") / "tags-rank0.safetensors"


def _line(entry: dict) -> bytes:
    text = json.dumps(entry, separators=(",", ":")).encode()
    return text + b" " + f"{zlib.crc32(text):08x}".encode() + b"\n"


def _tag(i: int, name: str | None = None) -> dict:
    return {"name": name or ("rare" if i % 50 == 0 else f"t{i % 7}"), "first_step": i % 5, "last_step": i % 5 + 1,
            "keep": "exact" if i % 11 == 0 else None, "capture_point": "train" if i % 3 == 0 else None,
            "attributes": {"i": i, "lr": 0.5 / (i + 1), "note": f"n{i % 4}", "flag": i % 2 == 0}, "rank": 0,
            "seq": i, "automatic": i % 2 == 1}  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store with batches of capture point ``train`` at steps 0..3 and 200 tags in ``tags-rank0.jsonl``."""
    path = tmp_path / "store"
    with StoreWriter(path) as writer:
        for step in range(4):
            factors = {"prefix": torch.ones(2, 1, 4), "suffix": torch.ones(2, 1, 3),
                       "sample": torch.arange(2).int(), "position": torch.zeros(2).int()}  # fmt: skip
            record = LayerRecord("fc", "outer", 2, {"weight": "fc.weight"}, {"weight": (3, 4)}, factors)
            writer.write([record], sample_ids=torch.arange(2), step=step, capture_point="train")
    (path / "tags-rank0.jsonl").write_bytes(b"".join(_line(_tag(i)) for i in range(200)))
    return path


def _expected(path: Path, tag: str | None = None, **attributes: object) -> list[tuple]:
    """``(name, steps, keep, attributes, automatic)`` of the file's tags that match, decoded here."""
    found = []
    for line in (path / "tags-rank0.jsonl").read_bytes().splitlines():
        entry = json.loads(line.rsplit(b" ", 1)[0])
        if (tag is None or entry["name"] == tag) and all(
            entry["attributes"].get(k) == v for k, v in attributes.items()
        ):
            steps = (entry["first_step"], entry["last_step"])
            found.append((entry["name"], steps, entry["keep"], entry["attributes"], entry["automatic"]))
    return found


def _answer(path: Path, tag: str | None = None, **attributes: object) -> list[tuple]:
    return [(f["name"], f["steps"], f["keep"], f["attributes"], f["automatic"]) for f in
            open_store(path).find(tag, **attributes)]  # fmt: skip


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Each line turned into a tag from now on; every test starts as a fresh process would (nothing parsed)."""
    import metastore_plugins.core.store.tags.book as tags_module
    from metastore_plugins.core.store.shards.journal import ParsedPrefixes

    parsed: list[dict] = []
    original = tags_module.tag_of
    monkeypatch.setattr(tags_module, "tag_of", lambda entry: parsed.append(entry) or original(entry))
    monkeypatch.setattr(tags_module, "_PARSED", ParsedPrefixes())
    return parsed


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget what this process parsed of tags files (as a new process would start)."""
    import metastore_plugins.core.store.tags.book as tags_module
    from metastore_plugins.core.store.shards.journal import ParsedPrefixes

    monkeypatch.setattr(tags_module, "_PARSED", ParsedPrefixes())


def test_find_answers_from_the_cache_and_parses_only_appended_lines(
    store: Path, parses: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first find() parses every line and writes the cache; a fresh process then parses none (before: all
    200), one appended line only that one, and its answers equal the file's lines (filters by name and attribute
    included); the steps' capture points come from the store."""
    assert _answer(store) == _expected(store) and len(parses) == 200 and (store / CACHE).is_file()
    _fresh(monkeypatch)
    parses.clear()
    assert _answer(store) == _expected(store) and parses == []
    assert _answer(store, "rare") == _expected(store, "rare") and len(_expected(store, "rare")) == 4
    assert _answer(store, note="n1", flag=False) == _expected(store, note="n1", flag=False) != []
    assert _answer(store, "t3", note="n1") == _expected(store, "t3", note="n1") != []
    assert _answer(store, "absent") == [] and _answer(store, note="absent") == []
    found = open_store(store).find("rare")
    assert [f["capture_points"] for f in found] == [["train"] if f["steps"][0] <= 3 else [] for f in found]
    with open(store / "tags-rank0.jsonl", "ab") as handle:  # another process appends
        handle.write(_line(_tag(200, name="late")))
    _fresh(monkeypatch)
    assert _answer(store) == _expected(store) and [p["name"] for p in parses] == ["late"]
    _fresh(monkeypatch)
    parses.clear()
    assert _answer(store, "late") == _expected(store, "late") and parses == []  # the cache took the appended line


def test_a_tags_file_rewritten_with_the_same_size_and_crcs_is_never_answered_from_the_cache(
    store: Path, parses: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line rewritten in place (same length, CRC recomputed, size and name of the file kept) after the cache was
    built: the next find() answers the new text."""
    open_store(store).find()
    assert (store / CACHE).is_file()  # built: what follows is answered against it
    path = store / "tags-rank0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    entry = json.loads(lines[101].rsplit(b" ", 1)[0])  # t3 on steps 1..2
    changed = {**entry, "name": "ra", "first_step": 2}
    lines[101] = _line(changed)
    data = b"".join(lines)
    assert len(data) == path.stat().st_size
    path.write_bytes(data)
    _fresh(monkeypatch)
    assert _answer(store) == _expected(store) and _answer(store)[101][:2] == ("ra", (2, 2))


def test_a_damaged_cache_is_rebuilt_never_trusted_and_removed_by_repair(
    store: Path, parses: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes of the cache's columns changed (size kept), or the cache cut short: find() answers from the tags file
    and writes a sound cache again; ``repair`` removes a damaged one and keeps a sound one."""
    open_store(store).find()
    cache = store / CACHE
    sound = cache.read_bytes()
    assert open_store(store).verify() == []  # a cache is no problem of the store
    for damaged in (sound[:-40] + bytes(b ^ 0x5A for b in sound[-40:]), sound[: len(sound) // 2]):
        cache.write_bytes(damaged)
        _fresh(monkeypatch)
        parses.clear()
        assert _answer(store) == _expected(store) and len(parses) == 200
        _fresh(monkeypatch)
        parses.clear()
        assert _answer(store) == _expected(store) and parses == []  # rebuilt, and sound: used
    assert not any("tag cache" in line for line in repair(store))
    cache.write_bytes(sound[:-40] + bytes(b ^ 0x5A for b in sound[-40:]))
    leftover = cache.with_name(cache.name + ".0123456789abcdef.tmp")
    leftover.write_bytes(sound[:100])  # a writer stopped before its rename
    done = repair(store)
    assert any("tags-rank0.safetensors: damaged tag cache removed" in line for line in done)
    assert any("0123456789abcdef.tmp: leftover temporary" in line for line in done) and not leftover.exists()
    assert not cache.exists()
    assert open_store(store).verify() == []  # a missing cache is nothing to report


_READ_ONLY = 'd="$1"; shift; mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" && exec "$@"'
_PROBE = """
import json, sys
from metastore_plugins import open_store
found = open_store(sys.argv[1]).find("rare")
print(json.dumps([[f["name"], list(f["steps"]), f["attributes"]] for f in found]))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (user and mount namespaces)")
def test_a_read_only_store_answers_without_writing_its_cache(store: Path) -> None:
    """The store mounted read-only (kernel EROFS, in a user and mount namespace): find() answers, no traceback, and
    no cache is written."""
    command = ["unshare", "-rm", "sh", "-c", _READ_ONLY, "sh", str(store), sys.executable, "-c", _PROBE, str(store)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env={**os.environ})
    if done.returncode != 0 and "unshare" in done.stderr and "Traceback" not in done.stderr:
        pytest.skip(f"user namespaces are off here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    expected = [[name, list(steps), attributes] for name, steps, _, attributes, _ in _expected(store, "rare")]
    assert json.loads(done.stdout) == expected
    assert not (store / "tag_cache").exists()
