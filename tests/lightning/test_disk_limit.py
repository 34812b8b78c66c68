"""A full disk (a file-size limit, RLIMIT_FSIZE) stops capture mid-run: the store records from which step it is
incomplete, and inspect, verify, queries, the report files and the end-of-run line say so.

disk_limit_worker.py trains 3 epochs of 8 steps in a subprocess whose files may not pass LIMIT bytes (SIGXFSZ
ignored: a write past it fails with EFBIG); the store writes one shard per epoch. Under 1 MiB, epoch 0's shard
(0.6 MB) is written and epoch 1's (1.4 MB, with the checkpoint pass) is not; under 256 KiB none is. The
reference is what the model was fed (``seen.log``), the shard file read with safetensors itself, and this
process reading the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("resource")  # POSIX only: the worker sets RLIMIT_FSIZE

pytestmark = pytest.mark.slow  # training runs in a subprocess (about 15 s each)

from safetensors.torch import load_file  # noqa: E402

from metastore_plugins import open_store  # noqa: E402
from metastore_plugins.cli import main  # noqa: E402
from metastore_plugins.core.errors import IncompleteStoreWarning  # noqa: E402

WORKER = Path(__file__).parent / "disk_limit_worker.py"
STEPS, BATCH, PASS_SAMPLES = 24, 32, 256 + 64  # 3 epochs of 8 steps; the pass: every train and val sample
START = 64  # the pass before the first step: the validation samples, in 2 batches (the shard's first)


def _run(out: Path, limit: int) -> str:
    """Run the worker under ``limit``; its stderr (the callback's lines and warnings)."""
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out), str(limit)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]  # training goes on after the disk error
    return done.stderr


def _fed(out: Path) -> list[list[int]]:
    return [[int(r) for r in line.split()] for line in (out / "seen.log").read_text().splitlines()]


def test_a_full_disk_mid_run_is_recorded_and_said_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stderr = _run(tmp_path, 2**20)
    fed = _fed(tmp_path)
    assert len(fed) == STEPS
    store_dir = tmp_path / "store"
    shards = sorted(p.name for p in store_dir.glob("*.safetensors"))
    assert shards == ["rank0-000000.safetensors"]  # epoch 0's; epoch 1's was refused
    on_disk = load_file(str(store_dir / shards[0]))
    batches = [on_disk[f"b{j}/meta/sample_id"].tolist() for j in range(2 + 8)]  # in the order the writer took them
    starts = [list(range(0, START // 2)), list(range(START // 2, START))]
    assert sorted(batches) == sorted([*starts, *fed[:8]])  # the start pass's 2 batches and the 8 steps: nothing else
    stored_ids = [row for step in fed[:8] for row in step]
    lost = (STEPS - 8) * BATCH + PASS_SAMPLES
    line = (
        "INCOMPLETE store: capture stopped at step 8 after an error writing the store (OSError: [Errno 27] File too "
        f"large): nothing from step 8 on was stored, {lost} sample(s) lost"
    )
    store = open_store(store_dir)
    assert store.steps("train") == list(range(8)) and store.capture_points() == ["start/val", "train"]
    assert store.verify() == [line]
    assert store.sample_ids("train", steps=(0, 7)).tolist() == stored_ids  # before the stop: no warning
    assert store.sample_ids("start/val").tolist() == list(range(START))
    with pytest.warns(IncompleteStoreWarning, match="capture stopped at step 8") as said:
        store.norms("train")
    assert len(said) == 1  # once per query, however many batches it reads
    assert main(["verify", str(store_dir)]) == 1
    assert line in capsys.readouterr().out.splitlines()
    assert main(["inspect", str(store_dir)]) == 1
    text = capsys.readouterr().out.splitlines()
    assert line in text and "run        finished; last step stored: 7" in text
    assert any(
        t.startswith("  epoch-1 ") and t.endswith("NOT STORED (capture had stopped: see incomplete)") for t in text
    )
    assert line in [t.rstrip() for t in (store_dir / "reports" / "outliers.md").read_text().splitlines()]  # caption
    assert f"store {store_dir} written ({line}), reports in" in stderr


def test_a_full_disk_before_the_first_shard_gives_the_disk_error_as_the_reason(tmp_path: Path) -> None:
    stderr = _run(tmp_path, 2**18)
    assert len(_fed(tmp_path)) == STEPS
    store_dir = tmp_path / "store"
    assert not list(store_dir.glob("*.safetensors")) and (store_dir / "index-rank0.jsonl").stat().st_size == 0
    line = (
        "INCOMPLETE store: capture stopped at step 0 after an error writing the store (OSError: [Errno 27] File too "
        f"large): nothing from step 0 on was stored, {STEPS * BATCH + PASS_SAMPLES + START:,} sample(s) lost"
    )
    assert open_store(store_dir).verify() == [line]
    assert f"no reports: the store {store_dir} holds no checkpoint passes 'epoch-*/train' ({line})" in stderr
    assert "turned off" not in stderr
    assert f"store {store_dir} written ({line}), no reports" in stderr
    assert os.path.getsize(store_dir / "run-rank0.jsonl") > 0
