"""A damaged, stale or left-over nearest-gradient index: ``verify`` says it, ``verify --repair`` removes it (a cache),
and the next query rebuilds it; the answers are always the exhaustive scan's (``k=None``), never a wrong top-k.

The cases tests/store_queries/test_vector_index.py already covers (a bit flip in a part, the manifest or the
FAISS file; a link at the folder or at a part; temporaries) are not repeated; here: truncation, a manifest
that lists a missing part or another part's file, a link at the manifest, and repair of each.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_vector_index import TEST, TRAIN, K, assert_same_top, base, damage, make_model, store, write_pass

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.store.maintenance.compaction import compact
from metastore_plugins.core.store.vectors import vector_files

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

FOLDER = vector_files.FOLDER


def manifest_path(path: Path) -> Path:
    return sorted((path / FOLDER).glob("manifest-*"))[0]


def rewrite_manifest(path: Path, change: Callable[[dict], None]) -> None:
    """Edit the manifest and seal it with a valid CRC: damage only a checksum of its files can catch."""
    target = manifest_path(path)
    manifest = vector_files.decode_manifest(target.read_bytes())
    change(manifest)
    target.write_bytes(vector_files.encode_manifest(manifest))


def truncate(victim: Path) -> None:
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])


def missing_part(path: Path) -> None:
    sorted((path / FOLDER).glob("part-*"))[1].unlink()


def swapped_parts(path: Path) -> None:
    def swap(manifest: dict) -> None:
        first, second = manifest["parts"][:2]
        first["file"], second["file"] = second["file"], first["file"]

    rewrite_manifest(path, swap)


def relabelled_parts(path: Path) -> None:
    """Two parts' files and sha256 swapped: each entry names a sound file, but another shard's part."""

    def swap(manifest: dict) -> None:
        first, second = manifest["parts"][:2]
        for key in ("file", "sha256"):
            first[key], second[key] = second[key], first[key]

    rewrite_manifest(path, swap)


def linked_manifest(path: Path) -> None:
    target = manifest_path(path)
    outside = path.parent / "outside-manifest.json"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    os.symlink(outside, target)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated part": lambda path: truncate(sorted((path / FOLDER).glob("part-*"))[0]),
    "truncated manifest": lambda path: truncate(manifest_path(path)),
    "missing part": missing_part,
    "swapped parts": swapped_parts,
    "relabelled parts": relabelled_parts,
    "linked manifest": linked_manifest,
    "bit flip": lambda path: damage(sorted((path / FOLDER).glob("part-*"))[-1]),
}


def shard_bytes(path: Path) -> dict[str, str]:
    """sha256 of every file of the store outside ``vector_index/`` (repair of the index never touches them)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.is_symlink() and FOLDER not in p.relative_to(path).parts
    }


def quiet_query(store: GradientStore, index: bool | None) -> object:
    """``influence(k=K)`` that must give no warning (nothing damaged is left to say)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return store.influence(TRAIN, TEST, k=K, index=index)


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damage_is_said_in_one_line_and_the_answer_is_the_exhaustive_one(store: GradientStore, how: str) -> None:
    store.build_vector_index(TRAIN)
    DAMAGE[how](store.path)
    problems = store.verify()
    assert problems and all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)
    assert len(problems) == (2 if "parts" in how else 1)
    with pytest.warns(UserWarning) as caught:
        fast = store.influence(TRAIN, TEST, k=K, index=True)
    assert all("\n" not in str(w.message) for w in caught)
    assert_same_top(fast, store.influence(TRAIN, TEST))
    assert store.verify() == []  # rebuilt and kept
    assert_same_top(quiet_query(store, None), store.influence(TRAIN, TEST))


@pytest.mark.parametrize("how", list(DAMAGE))
def test_repair_removes_the_damaged_index_and_the_next_query_rebuilds_it(
    store: GradientStore, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store.build_vector_index(TRAIN)
    before = shard_bytes(store.path)
    DAMAGE[how](store.path)
    assert main(["verify", str(store.path)]) == 1
    out = capsys.readouterr().out
    assert f"{FOLDER}/" in out and ("problems: 2" if "parts" in how else "problems: 1") in out
    assert main(["verify", str(store.path), "--repair"]) == 0
    out = capsys.readouterr().out
    assert "repaired: vector_index/" in out and out.rstrip().endswith("problems: none")
    assert shard_bytes(store.path) == before  # no shard, journal or manifest of the store touched
    repaired = open_store(store.path)
    assert repaired.verify() == []
    kept = vi.open_index(repaired, TRAIN, build=False)  # what repair kept is sound: no warning
    if "manifest" in how:
        assert kept is None  # removed with its files: `auto` scans every row, `build` builds again
        assert len(quiet_query(repaired, None).row_ids) == 360  # type: ignore[attr-defined]
    else:
        assert kept is not None and len(kept.rebuilt) >= 1  # the removed parts, rebuilt by the next query
    assert_same_top(quiet_query(repaired, True), repaired.influence(TRAIN, TEST))
    assert vi.open_index(repaired, TRAIN, build=False).rebuilt == []  # type: ignore[union-attr]
    assert main(["verify", str(store.path), "--repair"]) == 0
    assert "repaired:" not in capsys.readouterr().out  # nothing left to remove


def test_repair_removes_a_stale_index_and_leftovers_never_shards(
    store: GradientStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """Compaction replaces the shards: every part is stale (not damage: verify states it and still passes)."""
    store.build_vector_index(TRAIN)
    folder = store.path / FOLDER
    (folder / "part-0123456789abcdef-rank0-000099.safetensors").write_bytes(b"a part no manifest lists")
    (folder / f"{manifest_path(store.path).name}.0123456789abcdef.tmp").write_bytes(b"torn")
    (folder / "notes.txt").write_bytes(b"not the index's")
    compact(store.path, target_bytes=1 << 30)
    compacted = open_store(store.path)
    problems = compacted.verify()
    assert len(problems) == 1 and "temporary file left by a stopped index build" in problems[0]
    assert main(["verify", str(store.path)]) == 1
    assert "stale: rebuilt by the next query" in capsys.readouterr().out
    before = shard_bytes(store.path)
    assert main(["verify", str(store.path), "--repair", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert shard_bytes(store.path) == before
    assert any("stale" in line for line in report["removed"])
    assert any("listed by no manifest" in line for line in report["removed"])
    assert any("temporary file" in line for line in report["removed"])
    assert report["problems"] == [] and "stale" not in " ".join(report["vector_index"])
    assert sorted(p.name for p in folder.iterdir()) == [manifest_path(store.path).name, "notes.txt"]
    repaired = open_store(store.path)
    assert_same_top(quiet_query(repaired, None), repaired.influence(TRAIN, TEST))  # kept manifest: rebuilt
    assert len(vi.open_index(repaired, TRAIN, build=False).sample_ids) == 360  # type: ignore[union-attr]


def test_repair_removes_a_link_at_the_folder_not_its_target(store: GradientStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"x")
    os.symlink(outside, store.path / FOLDER)
    assert main(["verify", str(store.path), "--repair"]) == 0
    assert not os.path.lexists(store.path / FOLDER) and (outside / "kept").read_bytes() == b"x"
    assert_same_top(quiet_query(open_store(store.path), True), store.influence(TRAIN, TEST))


def test_verify_states_the_index(store: GradientStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(store.path)]) == 0
    assert "vector index: none" in capsys.readouterr().out
    store.build_vector_index(TRAIN)
    model, x, y = make_model()
    write_pass(store.path, model, x, y, TRAIN, torch.arange(400, 440))  # a new shard: its part is missing
    assert main(["verify", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert "vector index: 1" in out and f"{TRAIN:<20} 360 rows of 2 layers x 16^2, flat" in out
