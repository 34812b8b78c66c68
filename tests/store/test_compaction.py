"""The append-only index, compaction (also killed mid-way) and repair, against gradients built by einsum."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from storecases import FP32_ROUNDOFF, journal_entries, synthetic_batch

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.cli import main as cli_main
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.maintenance.compaction import compact, repair

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 12


def _write(path: Path, encoding: str = "fp32", steps: range = range(STEPS)) -> dict[int, dict[str, torch.Tensor]]:
    """One shard per step (shard_bytes=1); sample ids 10*step + 0..3, labels and losses given."""
    expected = {}
    with StoreWriter(path, encoding=encoding, shard_bytes=1, flush_seconds=None) as writer:
        for step in steps:
            records, grads = synthetic_batch(step)
            ids = torch.arange(4) + 10 * step
            writer.write(records, sample_ids=ids, step=step, labels=ids % 3, losses=ids.float() / 7, lr=0.1 * step)
            expected.update({int(i): {k: v[pos] for k, v in grads.items()} for pos, i in enumerate(ids)})
    return expected


def _check(path: Path, expected: dict[int, dict[str, torch.Tensor]], atol: float = 0.0) -> None:
    store = open_store(path)
    for sample, grads in expected.items():
        restored = store.restore(sample)
        for name, value in grads.items():
            if atol:
                torch.testing.assert_close(restored[name], value, rtol=0, atol=atol)
            else:
                torch.testing.assert_close(restored[name], value, **FP32_ROUNDOFF)


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.safetensors"))}


def test_adding_a_shard_appends_one_line_and_leaves_the_manifest_alone(tmp_path: Path) -> None:
    _write(tmp_path, steps=range(2))
    manifest = (tmp_path / "manifest-rank0.json").read_bytes()
    sizes = []
    with StoreWriter(tmp_path, encoding="fp32", shard_bytes=1, flush_seconds=None) as writer:
        for step in range(2, 8):
            records, _ = synthetic_batch(step)
            writer.write(records, sample_ids=torch.arange(4) + 10 * step, step=step, lr=0.1)
            writer.flush()
            sizes.append((tmp_path / "index-rank0.jsonl").stat().st_size)
    assert (tmp_path / "manifest-rank0.json").read_bytes() == manifest  # no layer changed: never rewritten
    growth = np.diff(sizes)
    assert growth.max() - growth.min() <= 8  # one line of the same length per shard (digits of numbers aside)
    assert len(journal_entries(tmp_path)) == 8


def test_compaction_merges_small_shards_and_keeps_every_batch(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    before = open_store(tmp_path)
    meta_before = before.metadata()
    report = compact(tmp_path, target_bytes=5 * (tmp_path / "rank0-000000.safetensors").stat().st_size)
    assert report.shards_before == STEPS and report.shards_after < STEPS // 3
    assert sorted(report.merged) == sorted(p for p in _digest_names(before))
    after = open_store(tmp_path)
    assert after.verify() == []
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(report.written)
    keys = 0
    for name in report.written:  # plain safetensors files, for safetensors' own reader too
        with safe_open(str(tmp_path / name), framework="pt") as handle:
            keys += len(list(handle.keys()))
            metadata = handle.metadata()
            assert {k: metadata[k] for k in ("format", "encoding")} == {"format": "metastore", "encoding": "fp32"}
            assert set(metadata) == {"format", "encoding", "index"}  # the shard's own description (repair)
    assert keys == 8 * STEPS  # per batch: sample_id, label, loss, an outer record (4 keys) and a dense one (1)
    meta_after = after.metadata()
    for column, values in meta_before.items():
        np.testing.assert_array_equal(meta_after[column], values, err_msg=column)
    assert [r.lr for r in after.batch_refs("train")] == [r.lr for r in before.batch_refs("train")]
    _check(tmp_path, expected)
    assert compact(tmp_path, target_bytes=1 << 30).merged  # the merged shards merge further
    _check(tmp_path, expected)
    assert compact(tmp_path).merged == []  # nothing left to merge


def _digest_names(store: object) -> list[str]:
    return [entry.file for entry in store.index.shards]  # type: ignore[attr-defined]


def test_compaction_keeps_encodings_apart(tmp_path: Path) -> None:
    expected = _write(tmp_path, "fp32", range(0, 4))
    expected.update(_write(tmp_path, "int8", range(4, 8)))
    compact(tmp_path)
    store = open_store(tmp_path)
    assert store.summary()["shards"] == 2 and store.summary()["encodings"] == ["fp32", "int8"]
    assert store.verify() == []
    _check(tmp_path, expected, atol=0.05)


def test_compaction_refuses_a_rank_in_use(tmp_path: Path) -> None:
    _write(tmp_path, steps=range(3))
    with StoreWriter(tmp_path, encoding="fp32"), pytest.raises(StoreError, match="in use by another writer"):
        compact(tmp_path)
    assert len(compact(tmp_path).merged) == 3  # the writer closed: the lock is free


KILL = textwrap.dedent(
    """
    import os, signal, sys
    from metastore_plugins.core.store.maintenance import compaction as maintenance
    real = maintenance.rewrite
    def rewrite(path, lines):
        if {after}:
            real(path, lines)
        os.kill(os.getpid(), signal.SIGKILL)
    maintenance.rewrite = rewrite
    maintenance.compact(sys.argv[1])
    """
)


@pytest.mark.parametrize("after", [False, True], ids=["before-the-rename", "after-the-rename"])
def test_compaction_killed_leaves_the_store_reading_the_same(tmp_path: Path, after: bool) -> None:
    expected = _write(tmp_path)
    ids_before = open_store(tmp_path).sample_ids()
    listed_before = _digest(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", KILL.format(after=after), str(tmp_path)], cwd=ROOT, capture_output=True, timeout=120
    )
    assert done.returncode == -9, done.stderr
    store = open_store(tmp_path)
    np.testing.assert_array_equal(store.sample_ids(), ids_before)
    _check(tmp_path, expected)
    problems = store.verify()
    assert problems and all("not listed in the index" in line for line in problems), problems
    listed = {entry.file for entry in store.index.shards}
    assert (listed == set(listed_before)) != after  # before the rename the old shards are still the listed ones
    removed = repair(tmp_path)
    assert len(removed) == len(problems)
    assert open_store(tmp_path).verify() == [] and repair(tmp_path) == []
    assert {name: _digest(tmp_path)[name] for name in listed} == {
        name: digest for name, digest in _digest(tmp_path).items() if name in listed
    }
    _check(tmp_path, expected)


def test_repair_never_touches_a_listed_shard(tmp_path: Path) -> None:
    expected = _write(tmp_path, steps=range(4))
    listed = _digest(tmp_path)
    (tmp_path / "rank0-000009.safetensors").write_bytes(b"left by a killed writer")
    (tmp_path / "rank0-000010.safetensors.tmp").write_bytes(b"half")
    with open(tmp_path / "index-rank0.jsonl", "ab") as journal:
        journal.write(b'{"file": "rank0-0000')  # a torn tail
    removed = repair(tmp_path)
    assert any(line.startswith("rank0-000009.safetensors: set aside as quarantine/") for line in removed)  # unreadable
    assert any("rank0-000010.safetensors.tmp" in line for line in removed)
    assert any("line 5" in line for line in removed)
    assert _digest(tmp_path) == listed
    assert (tmp_path / "quarantine" / "rank0-000009.safetensors").read_bytes() == b"left by a killed writer"
    assert open_store(tmp_path).verify() == [
        "quarantine/: 1 file(s) set aside by `metastore verify --repair`; see docs/store.md#compaction-and-repair"
    ]
    _check(tmp_path, expected)


def test_cli_compact_and_repair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = _write(tmp_path, steps=range(6))
    (tmp_path / "rank0-000042.safetensors").write_bytes(b"orphan")
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert "rank0-000042.safetensors" in capsys.readouterr().out
    assert cli_main(["verify", str(tmp_path), "--repair"]) == 1  # an unreadable shard is set aside, not deleted
    out = capsys.readouterr().out
    assert "repaired: rank0-000042.safetensors: set aside as quarantine/rank0-000042.safetensors" in out
    assert "quarantine/: 1 file(s) set aside" in out
    assert cli_main(["compact", str(tmp_path)]) == 0
    assert "shards     6 -> 1" in capsys.readouterr().out
    _check(tmp_path, expected)
    assert cli_main(["compact", str(tmp_path / "nowhere")]) == 2
    assert "not a metastore store" in capsys.readouterr().err


HOLD = textwrap.dedent(
    """
    import sys, time
    from metastore_plugins import StoreWriter
    with StoreWriter(sys.argv[1], encoding="fp32"):
        print("open", flush=True)
        time.sleep(60)
    """
)


@pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")  # the holder's stdout pipe is left to the collector
def test_a_writer_in_another_process_holds_the_rank(tmp_path: Path) -> None:
    _write(tmp_path, steps=range(3))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreError, match="in use by another writer"):
            compact(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert len(compact(tmp_path).merged) == 3  # the lock went with the process


def test_processes_forked_while_a_writer_is_open_do_not_keep_its_rank(tmp_path: Path) -> None:
    """A DataLoader's workers fork from the training process: the rank is free once its writer closes."""
    import multiprocessing

    _write(tmp_path, steps=range(3))
    context = multiprocessing.get_context("fork")
    with StoreWriter(tmp_path, encoding="fp32"):
        worker = context.Process(target=time.sleep, args=(30,))
        worker.start()
    try:
        assert len(compact(tmp_path).merged) == 3
    finally:
        worker.kill()
        worker.join()
