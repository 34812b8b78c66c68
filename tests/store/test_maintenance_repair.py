"""Repair never loses a readable sample (issue 28 item 1, issue 29): a shard whose journal line was damaged, torn,
never written, or names what the manifest lost is listed again from the shard's own description, a manifest that
is gone is rebuilt from the shards, a line this version cannot read is kept with its shard, and a shard that
cannot be listed again is set aside, never deleted. Every file inside and outside the store is hashed before and
after; the samples are compared with the shards' own tensors read with safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hostilecases import build_store, column, edit_line, journal, sha256, shard
from maintenancecases import changed, shard_ids, shard_samples, tree
from safetensors import safe_open
from storecases import FP32_ROUNDOFF

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.maintenance.compaction import repair
from metastore_plugins.core.store.writing import writer as writer_module

SHARDS = 6
RELISTED = "listed again (its journal line rebuilt from the shard's own description)"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Six fp32 shards of one batch of 4 samples (written by today's writer), and a decoy file beside the store."""
    path = tmp_path / "store"
    build_store(path, shards=SHARDS)
    (tmp_path / "outside.txt").write_text("someone else's file")
    return path


@pytest.fixture
def undescribed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The same store as written before shards described themselves (no ``index`` header key)."""
    monkeypatch.setattr(writer_module, "describe", lambda *args: {}, raising=False)  # raising: the code before it
    path = tmp_path / "store"
    build_store(path, shards=SHARDS)
    monkeypatch.undo()
    with safe_open(str(shard(path, 0)), framework="pt") as handle:
        assert "index" not in handle.metadata()
    (tmp_path / "outside.txt").write_text("someone else's file")
    return path


def _lines(path: Path) -> list[bytes]:
    return journal(path).read_bytes().splitlines(keepends=True)


def _all_ids(path: Path) -> list[int]:
    return sorted(i for s in range(SHARDS) for i in shard_ids(shard(path, s)))


def _answers_as_its_shards(path: Path) -> None:
    """Every sample of every shard is listed, once, with the gradients, labels and steps its shard holds."""
    opened = open_store(path)
    assert opened.verify() == []
    assert sorted(opened.sample_ids().tolist()) == _all_ids(path)
    meta = opened.metadata()
    for s in range(SHARDS):
        for sample, grads in shard_samples(shard(path, s)).items():
            restored = opened.restore(sample)
            for name, value in grads.items():
                torch.testing.assert_close(restored[name], value, **FP32_ROUNDOFF)
        with safe_open(str(shard(path, s)), framework="pt") as handle:
            ids, labels = handle.get_tensor("b0/meta/sample_id"), handle.get_tensor("b0/meta/label")
        rows = [meta["sample_id"].tolist().index(i) for i in ids.tolist()]
        assert meta["label"][rows].tolist() == labels.tolist()
        assert meta["step"][rows].tolist() == [s] * len(rows)  # build_store: shard s holds step s


def test_a_first_line_overwritten_is_rebuilt_from_its_shard(store: Path) -> None:
    """Issue 28 item 1: 10 bytes of the first line overwritten; repair removed the shard and left 0 samples."""
    data = bytearray(journal(store).read_bytes())
    data[40:50] = b"XXXXXXXXXX"
    journal(store).write_bytes(bytes(data))
    assert open_store(store).summary()["samples"] == 4 * (SHARDS - 1)
    before = tree(store.parent)
    assert repair(store) == [
        "removed: index-rank0.jsonl line 1: damaged: its CRC-32 does not match its content; ignored",
        f"rank0-000000.safetensors: {RELISTED}",
    ]
    assert changed(before, tree(store.parent)) == {"store/index-rank0.jsonl"}  # every shard and outside file as it was
    _answers_as_its_shards(store)
    assert repair(store) == []


def test_a_line_whose_crc_alone_is_damaged_is_rebuilt(store: Path) -> None:
    """Issue 29: one bad CRC although the shard's sha256 still matches."""
    lines = _lines(store)
    text, crc = lines[2].rstrip(b"\n").rsplit(b" ", 1)
    lines[2] = text + b" " + (b"0" if crc[:1] != b"0" else b"1") + crc[1:] + b"\n"
    journal(store).write_bytes(b"".join(lines))
    before = tree(store.parent)
    assert repair(store)[-1] == f"rank0-000002.safetensors: {RELISTED}"
    assert changed(before, tree(store.parent)) == {"store/index-rank0.jsonl"}
    _answers_as_its_shards(store)


def test_a_shard_whose_line_was_never_written_is_listed_again(store: Path) -> None:
    """A writer killed after the shard's rename and before its line: the shard is whole, its samples the only copy."""
    journal(store).write_bytes(b"".join(_lines(store)[:-1]))
    before = tree(store.parent)
    assert repair(store) == [f"rank0-000005.safetensors: {RELISTED}"]
    assert changed(before, tree(store.parent)) == {"store/index-rank0.jsonl"}
    _answers_as_its_shards(store)


def test_a_missing_manifest_is_rebuilt_from_the_shards(store: Path) -> None:
    """Issue 29: repair deleted the listed shards of a rank whose manifest was missing."""
    layers = json.loads((store / "manifest-rank0.json").read_text())["layers"]
    (store / "manifest-rank0.json").unlink()
    before = tree(store.parent)
    assert repair(store) == ["manifest-rank0.json: rebuilt from the layers its shards describe (its config is lost)"]
    assert changed(before, tree(store.parent)) == {"store/manifest-rank0.json"}  # the journal reads as it is
    assert json.loads((store / "manifest-rank0.json").read_text())["layers"] == layers
    _answers_as_its_shards(store)


def test_a_missing_manifest_is_not_guessed_from_shards_that_do_not_describe_themselves(undescribed: Path) -> None:
    (undescribed / "manifest-rank0.json").unlink()
    before = tree(undescribed.parent)
    [refusal] = repair(undescribed)
    assert refusal.startswith("rank 0: NOT repaired: manifest-rank0.json is missing and cannot be rebuilt (")
    assert refusal.endswith(
        "restore manifest-rank0.json (from a backup or another copy of the store) and run repair again; "
        "nothing of rank 0 was changed"
    )
    assert changed(before, tree(undescribed.parent)) == set()


def test_a_layer_the_manifest_lost_is_restored_from_the_shards(store: Path) -> None:
    """Issue 29: with a layer missing from the manifest, repair deleted all the intact shards."""
    manifest = json.loads((store / "manifest-rank0.json").read_text())
    damaged = {**manifest, "layers": {"fc": manifest["layers"]["fc"]}}
    (store / "manifest-rank0.json").write_text(json.dumps(damaged))
    assert open_store(store).summary()["samples"] == 0
    before = tree(store.parent)
    assert repair(store) == [
        "manifest-rank0.json: layer(s) 'ln' added from rank0-000000.safetensors's own description "
        "(index-rank0.jsonl line 1 names them)"
    ]
    assert changed(before, tree(store.parent)) == {"store/manifest-rank0.json"}
    assert json.loads((store / "manifest-rank0.json").read_text())["layers"] == manifest["layers"]
    _answers_as_its_shards(store)


def test_a_line_with_a_future_column_is_kept_with_its_shard(store: Path) -> None:
    """Issue 29: repair deleted the shard of a line carrying an unknown, future additive column."""
    edit_line(store, 1, lambda entry: entry["samples"].update(weight=column([0.5] * 4, "f4")))
    before = tree(store.parent)
    [kept] = repair(store)
    assert kept.startswith("index-rank0.jsonl line 2: NOT repaired, kept as it is with its shard rank0-000001")
    assert "unknown column(s) ['weight']" in kept
    assert changed(before, tree(store.parent)) == set()  # the line byte for byte, the shard untouched


def test_a_shard_that_cannot_be_listed_again_is_set_aside_not_deleted(undescribed: Path) -> None:
    lines = _lines(undescribed)
    lines[3] = lines[3].replace(b'"encoding":"fp32"', b'"encoding":"fp33"')
    journal(undescribed).write_bytes(b"".join(lines))
    digest = sha256(shard(undescribed, 3))
    before = tree(undescribed.parent)
    done = repair(undescribed)
    assert done[1].startswith("rank0-000003.safetensors: set aside as quarantine/rank0-000003.safetensors (")
    assert "does not describe its batches" in done[1] and "NOT deleted" in done[1]
    assert changed(before, tree(undescribed.parent)) == {
        "store/index-rank0.jsonl",
        "store/rank0-000003.safetensors",
        "store/quarantine",
        "store/quarantine/rank0-000003.safetensors",
    }
    assert sha256(undescribed / "quarantine" / "rank0-000003.safetensors") == digest
    problems = open_store(undescribed).verify()
    assert problems == [
        "quarantine/: 1 file(s) set aside by `metastore verify --repair`; see docs/store.md#compaction-and-repair"
    ]


def test_a_quarantine_that_is_a_link_is_refused(undescribed: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (undescribed / "quarantine").symlink_to(outside)
    lines = _lines(undescribed)
    journal(undescribed).write_bytes(b"".join(lines[:-1]))
    with pytest.raises(StoreError, match="quarantine: is a symbolic link"):
        repair(undescribed)
    assert list(outside.iterdir()) == [] and shard(undescribed, 5).exists()


def test_a_copy_left_by_compaction_is_removed_and_a_different_shard_is_not(store: Path) -> None:
    """A byte-for-byte copy of listed batches is removed (old repair removed it too, as it removed every unlisted
    shard: kept here as the counterpart of the cases above)."""
    import shutil

    shutil.copyfile(shard(store, 4), shard(store, 9))
    before = tree(store.parent)
    assert repair(store) == [
        "rank0-000009.safetensors: removed (a copy: listed shards hold each of its batches byte for byte)"
    ]
    assert changed(before, tree(store.parent)) == {"store/rank0-000009.safetensors"}
    _answers_as_its_shards(store)


def test_a_shard_copied_under_another_rank_is_not_listed_there(store: Path) -> None:
    """A rank's shard under another rank's name (no manifest there): its description names its rank, so repair
    refuses to build rank 1 from it, and keeps the file."""
    import shutil

    shutil.copyfile(shard(store, 2), shard(store, 0, rank=1))
    before = tree(store.parent)
    [refusal] = repair(store)
    assert refusal.startswith("rank 1: NOT repaired: manifest-rank1.json is missing and cannot be rebuilt (")
    assert "describes a shard of rank 0, not of rank 1" in refusal
    assert changed(before, tree(store.parent)) == {"store/rank1.lock"}
    assert sorted(open_store(store).sample_ids().tolist()) == _all_ids(store)


def test_a_description_never_makes_a_header_a_reader_refuses(tmp_path: Path) -> None:
    """Short names: every shard describes itself. 40 layers of 1,000-character non-ASCII names (each 6,000 header
    bytes, escaped) in a one-batch shard: the description is left out and the shard still reads."""
    from metastore_plugins import StoreWriter
    from metastore_plugins.core.records import LayerRecord

    def records(names: list[str]) -> list[LayerRecord]:
        return [
            LayerRecord(name, "dense", 2, {"weight": "w"}, {"weight": (1,)}, {"grad.weight": torch.ones(2, 1)})
            for name in names
        ]

    for names, described in (
        ([f"layer{i}" for i in range(40)], True),
        ([f"{i}" + "é" * 999 for i in range(40)], False),
    ):
        path = tmp_path / str(described)
        with StoreWriter(path, encoding="fp32", shard_bytes=1) as writer:
            writer.write(records(names), sample_ids=torch.arange(2), step=0)
        with safe_open(str(shard(path, 0)), framework="pt") as handle:
            assert ("index" in handle.metadata()) == described
        assert open_store(path).verify() == []


@pytest.mark.parametrize("differs", ["capture_point", "step"])
def test_equal_tensors_of_another_batch_are_not_a_copy(tmp_path: Path, differs: str) -> None:
    """Issue 44: one batch stored twice with byte-for-byte equal tensors (the weights did not move between two
    capture points, or two steps). The first shard's journal line is damaged: repair lists it again from its own
    description instead of removing it as "a copy" of the other batch. Reference: the samples each shard file
    holds, read with safetensors, and the capture points and steps the test wrote."""
    from metastore_plugins import StoreWriter
    from metastore_plugins.core.records import LayerRecord

    path = tmp_path / "store"
    record = LayerRecord("fc", "dense", 4, {"weight": "w"}, {"weight": (3,)}, {"grad.weight": torch.ones(4, 3)})
    batches = {"capture_point": [("epoch-0/train", 4), ("epoch-1/train", 4)], "step": [("train", 4), ("train", 5)]}
    with StoreWriter(path, encoding="fp32", shard_bytes=1) as writer:
        for capture_point, step in batches[differs]:
            writer.write([record], sample_ids=torch.arange(4), step=step, capture_point=capture_point)
    lines = _lines(path)
    journal(path).write_bytes(lines[0][:-3] + b"00\n" + lines[1])  # a CRC-damaged line for shard 0
    assert repair(path) == [
        "removed: index-rank0.jsonl line 1: damaged: its CRC-32 does not match its content; ignored",
        f"rank0-000000.safetensors: {RELISTED}",
    ]
    assert shard(path, 0).exists() and shard(path, 1).exists()
    opened = open_store(path)
    assert sorted(opened.capture_points()) == sorted({point for point, _ in batches[differs]})
    for capture_point, step in batches[differs]:
        assert step in opened.steps(capture_point)
        assert sorted(opened.sample_ids(capture_point, steps=step).tolist()) == [0, 1, 2, 3]
    assert sorted(opened.sample_ids().tolist()) == sorted(shard_ids(shard(path, 0)) + shard_ids(shard(path, 1)))
