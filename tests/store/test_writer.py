"""StoreWriter: backpressure, checksums, verify, crash safety, resume, and bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from storecases import FP32_ROUNDOFF, journal_entries, synthetic_batch

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store.writing import writer as writer_module

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _batch_bytes(records: list[LayerRecord], size: int) -> int:
    """Bytes the caller hands over for one batch: record tensors plus ids (int64), labels (int64), losses (fp32)."""
    return sum(r.nbytes for r in records) + size * (8 + 8 + 4)


def _write_batches(writer: StoreWriter, seeds: range, size: int = 4) -> dict[int, dict[str, torch.Tensor]]:
    """Write one synthetic batch per seed (ids ``seed*size ...``); return sample id -> expected gradients."""
    expected = {}
    for seed in seeds:
        records, grads = synthetic_batch(seed, size)
        ids = torch.arange(size) + seed * size
        writer.write(records, sample_ids=ids, step=seed, labels=ids % 3, losses=ids.float() / 10)
        expected.update({int(i): {k: v[pos] for k, v in grads.items()} for pos, i in enumerate(ids.tolist())})
    return expected


def _assert_exact(path: Path, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    store = open_store(path)
    assert sorted(store.sample_ids().tolist()) == sorted(expected)
    for sample, grads in expected.items():
        restored = store.restore(sample)
        assert set(restored) == set(grads)
        for name, value in grads.items():
            torch.testing.assert_close(restored[name], value, **FP32_ROUNDOFF)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _listed(path: Path, rank: int = 0) -> list[dict[str, Any]]:
    """The journal's entries, with each shard's step and sample id ranges."""
    entries = journal_entries(path, rank)
    for entry in entries:
        steps, ids = entry["batches"]["step"][1], entry["samples"]["sample_id"][1]
        entry["steps"], entry["sample_ids"] = [min(steps), max(steps)], [min(ids), max(ids)]
    return entries


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every shard write take 20 ms so that the queue really fills."""
    save = writer_module.write_shard

    def slow_save(*args: Any, **kwargs: Any) -> tuple[int, str]:
        time.sleep(0.02)
        return save(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_shard", slow_save)


# -- backpressure and memory ---------------------------------------------------------------


def test_queue_and_pending_shard_stay_within_their_bounds(tmp_path: Path, slow_disk: None) -> None:
    records, _ = synthetic_batch(0)
    one = _batch_bytes(records, 4)
    queue_bytes, shard_bytes = 3 * one + one // 2, 2 * one
    with StoreWriter(tmp_path, encoding="fp32", queue_bytes=queue_bytes, shard_bytes=shard_bytes) as writer:
        expected = _write_batches(writer, range(20))
    stats = writer.stats
    assert 20 * one > 5 * queue_bytes  # far more than the queue was written
    assert stats.wait_seconds > 0.05  # training did wait on the slow disk ...
    assert 0 < stats.peak_queued_bytes <= queue_bytes  # ... and the queue never outgrew its bound
    assert stats.peak_queued_bytes >= 2 * one  # it did fill up
    assert stats.peak_pending_bytes <= shard_bytes + one  # fp32 encoding never grows a batch
    assert stats.shards == len(_shards(tmp_path)) >= 8 and stats.batches == 20
    assert stats.bytes_written == sum(p.stat().st_size for p in _shards(tmp_path))
    _assert_exact(tmp_path, expected)


def test_a_batch_larger_than_the_queue_is_written_alone(tmp_path: Path) -> None:
    records, _ = synthetic_batch(0, size=8)
    with StoreWriter(tmp_path, encoding="fp32", queue_bytes=100, shard_bytes=10) as writer:
        expected = _write_batches(writer, range(3), size=8)
    assert writer.stats.peak_queued_bytes == _batch_bytes(records, 8)  # one at a time, no deadlock
    assert writer.stats.shards == 3
    _assert_exact(tmp_path, expected)


# -- files, checksums and verify --------------------------------------------------------------


@pytest.fixture
def sound_store(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    records, _ = synthetic_batch(0)
    with StoreWriter(tmp_path, encoding="fp32", shard_bytes=_batch_bytes(records, 4)) as writer:
        expected = _write_batches(writer, range(4))
    return tmp_path, expected


def test_no_tmp_files_and_checksums_match_the_manifest(sound_store: tuple) -> None:
    path, _ = sound_store
    assert not list(path.glob("*.tmp"))
    listed = _listed(path)
    assert (
        [s["file"] for s in listed]
        == [p.name for p in _shards(path)]
        == [f"rank0-{i:06d}.safetensors" for i in range(4)]
    )
    for shard in listed:
        file = path / shard["file"]
        assert shard["sha256"] == _sha(file)
        assert shard["bytes"] == file.stat().st_size
        assert shard["encoding"] == "fp32"
    assert [s["steps"] for s in listed] == [[i, i] for i in range(4)]
    assert [s["sample_ids"] for s in listed] == [[4 * i, 4 * i + 3] for i in range(4)]
    assert open_store(path).verify() == []


def test_verify_reports_a_damaged_shard(sound_store: tuple) -> None:
    path, _ = sound_store
    victim = _shards(path)[1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # inside the tensor data, the size stays the same
    victim.write_bytes(bytes(data))
    problems = open_store(path).verify()
    assert len(problems) == 1 and victim.name in problems[0] and "sha256" in problems[0]


def test_verify_reports_a_truncated_shard(sound_store: tuple) -> None:
    path, _ = sound_store
    victim = _shards(path)[2]
    victim.write_bytes(victim.read_bytes()[:-10])
    problems = open_store(path).verify(checksums=False)
    assert len(problems) == 1 and victim.name in problems[0]


def test_verify_reports_a_missing_shard(sound_store: tuple) -> None:
    path, _ = sound_store
    victim = _shards(path)[0]
    victim.unlink()
    problems = open_store(path).verify()
    assert len(problems) == 1 and victim.name in problems[0] and "missing" in problems[0]


def test_verify_reports_an_unlisted_shard(sound_store: tuple) -> None:
    path, expected = sound_store
    orphan = path / "rank0-000042.safetensors"
    shutil.copy(_shards(path)[0], orphan)
    store = open_store(path)
    problems = store.verify()
    assert len(problems) == 1 and orphan.name in problems[0] and "not listed" in problems[0]
    assert sorted(store.sample_ids().tolist()) == sorted(expected)  # the orphan is not read


# -- crash safety and resume --------------------------------------------------------------------


CRASH = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {here!r})
    from storecases import FP32_ROUNDOFF, synthetic_batch
    from metastore_plugins import StoreWriter

    writer = StoreWriter({path!r}, encoding="fp32", shard_bytes=1500)
    for seed in range(3):
        records, _ = synthetic_batch(seed)
        writer.write(records, sample_ids=torch.arange(4) + 4 * seed, step=seed)
    writer.flush()
    print("flushed", flush=True)
    for seed in range(3, 40):
        records, _ = synthetic_batch(seed, size=64)
        writer.write(records, sample_ids=torch.arange(64) + 1000 * seed, step=seed)
    os._exit(9)
    """
)


def test_a_killed_writer_leaves_a_readable_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    code = CRASH.format(here=str(HERE), path=str(path))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    assert "flushed" in done.stdout
    flushed = {}
    for seed in range(3):
        _, grads = synthetic_batch(seed)
        flushed.update({4 * seed + pos: {k: v[pos] for k, v in grads.items()} for pos in range(4)})
    store = open_store(path)
    stored = set(store.sample_ids().tolist())
    assert set(flushed) <= stored
    for sample, grads in flushed.items():
        restored = store.restore(sample)
        for name, value in grads.items():
            torch.testing.assert_close(restored[name], value, **FP32_ROUNDOFF)
    # listed shards are whole; a shard renamed before its manifest entry is merely unlisted
    assert all("not listed" in problem or "temporary" in problem for problem in store.verify()), store.verify()
    # every stored sample of the killed tail is whole too
    for seed in range(3, 40):
        ids = [1000 * seed + pos for pos in range(64)]
        if ids[0] in stored:
            _, grads = synthetic_batch(seed, size=64)
            assert set(ids) <= stored
            torch.testing.assert_close(store.restore(ids[5])["fc.weight"], grads["fc.weight"][5], **FP32_ROUNDOFF)

    # resume: a new writer continues after every file on disk, old shards untouched
    before = {p.name: _sha(p) for p in _shards(path)}
    with StoreWriter(path, encoding="fp32") as writer:
        more = _write_batches(writer, range(50, 52))
    assert not list(path.glob("*.tmp"))
    after = {p.name: _sha(p) for p in _shards(path)}
    new = sorted(set(after) - set(before))
    assert new and all(name > max(before) for name in new)
    assert all(after[name] == sha for name, sha in before.items())
    store = open_store(path)
    assert set(flushed) | set(more) <= set(store.sample_ids().tolist())
    assert all("not listed" in problem for problem in store.verify())
    _assert_exact_subset(store, more)


def _assert_exact_subset(store: Any, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    for sample, grads in expected.items():
        restored = store.restore(sample)
        for name, value in grads.items():
            torch.testing.assert_close(restored[name], value, **FP32_ROUNDOFF)


def test_resume_continues_a_closed_store(sound_store: tuple) -> None:
    path, expected = sound_store
    before = {p.name: _sha(p) for p in _shards(path)}
    with StoreWriter(path, encoding="fp16", config={"note": "resumed"}) as writer:
        more = _write_batches(writer, range(10, 12))
    after = {p.name: _sha(p) for p in _shards(path)}
    assert sorted(set(after) - set(before)) == ["rank0-000004.safetensors"]
    assert all(after[name] == sha for name, sha in before.items())
    store = open_store(path)
    assert store.sample_ids().tolist() == sorted(expected) + sorted(more)
    assert store.summary()["encodings"] == ["fp16", "fp32"]  # encoding is per shard
    assert store.config == {"note": "resumed"}
    assert store.verify() == []
    _assert_exact_subset(store, expected)
    torch.testing.assert_close(store.restore(41)["ln.weight"], more[41]["ln.weight"], rtol=1e-3, atol=0)


# -- bad input ---------------------------------------------------------------------------------


def test_bad_input_raises_a_clear_error_and_keeps_stored_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="encoding must be one of fp32, fp16, bf16, int8; got 'fp8'"):
        StoreWriter(tmp_path / "other", encoding="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        StoreWriter(tmp_path / "other", shard_bytes=0)
    writer = StoreWriter(tmp_path, encoding="fp32")
    expected = _write_batches(writer, range(2))
    writer.flush()
    records, _ = synthetic_batch(7)
    with pytest.raises(ValueError, match="record of layer 'fc' holds 4 samples but 3 sample ids"):
        writer.write(records, sample_ids=[1, 2, 3], step=7)
    with pytest.raises(ValueError, match=r"labels must have one entry per sample \(4\)"):
        writer.write(records, sample_ids=[70, 71, 72, 73], step=7, labels=[0, 1])
    with pytest.raises(ValueError, match="capture_point must be a non-empty name"):
        writer.write(records, sample_ids=[70, 71, 72, 73], step=7, capture_point="")
    with pytest.raises(ValueError, match="capture_point must be a non-empty name"):
        writer.write(records, sample_ids=[70, 71, 72, 73], step=7, capture_point="  ")
    wider, _ = synthetic_batch(7, d_in=9)
    with pytest.raises(ValueError, match="layer 'fc' changed since it was first stored"):
        writer.write(wider, sample_ids=[70, 71, 72, 73], step=7)
    # a new layer in a rejected batch is not registered either
    new_layer = LayerRecord("extra", "dense", 4, {"w": "extra.w"}, {"w": (2,)}, {"grad.w": torch.ones(4, 2)})
    with pytest.raises(ValueError, match="changed"):
        writer.write([new_layer, wider[0]], sample_ids=[70, 71, 72, 73], step=7)
    # the writer still works after rejected batches
    records, grads = synthetic_batch(7)
    writer.write(records, sample_ids=[70, 71, 72, 73], step=7)
    expected.update({70 + pos: {k: v[pos] for k, v in grads.items()} for pos in range(4)})
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(records, sample_ids=[80, 81, 82, 83], step=8)
    writer.close()  # twice is fine
    store = open_store(tmp_path)
    assert store.verify() == []
    assert sorted(store.layers()) == ["fc", "ln"]
    assert store.steps() == [0, 1, 7]
    _assert_exact(tmp_path, expected)


def test_errors_in_the_writer_thread_reach_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(writer_module, "write_shard", broken)
    writer = StoreWriter(tmp_path, shard_bytes=1, on_error="raise")  # the default warns: tests/store/test_faults.py
    records, _ = synthetic_batch(0)
    writer.write(records, sample_ids=[0, 1, 2, 3], step=0)
    with pytest.raises(RuntimeError, match="disk full"):
        writer.flush()
    with pytest.raises(RuntimeError, match="disk full"):
        writer.write(records, sample_ids=[0, 1, 2, 3], step=1)


def test_new_layers_while_the_manifest_is_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training thread registers layers while the writer thread serializes the manifest."""
    from metastore_plugins.core.store.shards import manifest as mf

    write_manifest = mf.write_manifest

    def slow_write(directory: Path, manifest: dict[str, Any]) -> None:
        for _ in manifest["layers"]:  # a slow serializer: other threads run meanwhile
            time.sleep(0.002)
        write_manifest(directory, manifest)

    monkeypatch.setattr(mf, "write_manifest", slow_write)
    with StoreWriter(tmp_path, encoding="fp32", shard_bytes=1) as writer:
        for i in range(20):
            record = LayerRecord(
                f"l{i}", "dense", 1, {"w": f"l{i}.w"}, {"w": (1,)}, {"grad.w": torch.full((1, 1), float(i))}
            )
            writer.write([record], sample_ids=[i], step=i)
    store = open_store(tmp_path)
    assert len(store.layers()) == 20 and store.verify() == []
    assert [float(store.restore(i)[f"l{i}.w"]) for i in range(20)] == [float(i) for i in range(20)]


# -- opening ----------------------------------------------------------------------------------


def test_open_store_on_a_non_store_raises_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is not a metastore store: it does not exist"):
        open_store(tmp_path / "missing")
    with pytest.raises(StoreError, match="holds no manifest-rank"):
        open_store(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(StoreError, match="not a metastore store"):
        open_store(tmp_path / "file.txt")
    (tmp_path / "manifest-rank0.json").write_text("{not json")
    with pytest.raises(StoreError, match="cannot read manifest"):
        open_store(tmp_path)
    (tmp_path / "manifest-rank0.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(StoreError, match="is not a metastore manifest"):
        open_store(tmp_path)
    (tmp_path / "manifest-rank0.json").write_text(json.dumps({"format": "metastore", "schema_version": 99}))
    with pytest.raises(StoreError, match="schema version 99.*upgrade"):
        open_store(tmp_path)


def test_open_store_accepts_the_run_directory(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        expected = _write_batches(writer, range(1))
    np.testing.assert_array_equal(open_store(tmp_path).sample_ids(), sorted(expected))


def test_unknown_names_raise_store_error(sound_store: tuple) -> None:
    path, _ = sound_store
    store = open_store(path)
    with pytest.raises(StoreError, match="unknown capture point 'val' in .*; it has: train"):
        store.select("val")
    with pytest.raises(StoreError, match="unknown layer"):
        store.restore(0, layer="nope")
    with pytest.raises(StoreError, match="sample 12345 is not stored"):
        store.restore(12345)
    assert isinstance(StoreError("x"), ValueError)
